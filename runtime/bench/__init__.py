"""``kvfleet bench``: online serving benchmark (``serve``), offline engine comparison
(``compare``), workloads (``datasets``) and the report maths (``metrics``).
"""
