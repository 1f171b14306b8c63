"""``python -m radixserve.infra``: run NATS + Redis until Ctrl-C (see launcher.run_infra)."""

from __future__ import annotations

import sys

from radixserve.infra.cli import main

if __name__ == "__main__":
    sys.exit(main())
