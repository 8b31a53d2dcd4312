"""``kvfleet bench``: online serving benchmark (``serve``), offline engine comparison
(``compare``, its systems and the ``roofline``), kvfleet against its peers (the ``peers``
package), workloads (``datasets``), the report maths (``metrics``) and the machine's
description (``machine``). Entry point: :mod:`.cli`.
"""
