"""Pipeline parallelism: the section and the GPipe/circular loop (``gpipe``), the 1F1B schedule
(``one_f_one_b``, its timetable and its stage's work), and what they share: the spec and its
checks (``spec``), views, partitions and replicas."""
