"""Pipeline parallelism: the section and the GPipe/circular loop (``gpipe``), the 1F1B schedule
(``one_f_one_b``, its timetable), and the views, partitions and replicas they share."""
