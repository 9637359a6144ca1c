"""Prepared token datasets: ``prepare`` writes them, ``index`` reads them, ``loader`` feeds them.

``shardlib data prepare`` tokenizes text files, JSON lines or a saved Hugging Face dataset
into token shards plus a JSON index (``docs/data.md``); a training run with
``dataset=DIR`` (or ``dataset.mix=DIR:W,DIR:W``) reads them through grain, shuffled, sliced per
process and packed into rows with document masks.
"""
