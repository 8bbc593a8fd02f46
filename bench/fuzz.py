"""`make fuzz`: fuzz every Starling decoder and protocol handler (starling_testing/fuzz.py says how and why).

    python bench/fuzz.py               # 100k inputs per decoder (several minutes)
    python bench/fuzz.py --quick       # 2k per decoder, a smoke run
    python bench/fuzz.py --only avg.respond --n 20000 --seed 7
"""

import sys

from starling_testing.fuzz import main

if __name__ == "__main__":
    sys.exit(main())
