import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Tests use tiny models: one thread avoids OpenMP barrier stalls when the machine is busy.
os.environ.setdefault("OMP_NUM_THREADS", "1")
