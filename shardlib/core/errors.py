"""The one exception type for bad meshes, rules and configs.

Raised before compilation wherever possible; every message names the tensor, the dim, the
mesh axis and a fix, so a user never has to read an XLA traceback to learn what is wrong.
"""


class ShardingError(ValueError):
    """A mesh, rule table, annotation or config that cannot be laid out."""
