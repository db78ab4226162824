"""The course's measurement scripts (see README.md beside this file). Each runs from the
repository root as ``python -m benchmarks.NAME``, so the checkout's ``course_helper`` and the
shared ``benchmarks.cupti_check`` are imported without editing ``sys.path``."""
