# Imported before tests/conftest.py and the test modules, so before torch loads OpenMP, which reads
# its wait policy then: idle threads sleep instead of spinning. On 2 cores shared with other work,
# spinning threads made a 2-thread process's steps up to 30x slower (DMD: 0.2 s -> 7 s); the
# launches and spawned ranks inherit the setting.
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
