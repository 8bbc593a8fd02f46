"""`make bench-adversary`: hostile averaging partners against a real victim (starling_testing/adversary.py
says what each attack does; tests/test_adversary_avg.py asserts the bounds).

    python bench/adversary.py --write-docs   # the table of docs/reliability.md, "Hostile averaging partners"
"""

import sys

from starling_testing.adversary import main

if __name__ == "__main__":
    sys.exit(main())
