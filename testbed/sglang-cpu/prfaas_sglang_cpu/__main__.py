"""python -m prfaas_sglang_cpu args   # the CPU workarounds' engine arguments, as JSON
python -m prfaas_sglang_cpu check  # every workaround against the installed SGLang (exit 1: one no longer holds)
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from prfaas_sglang_cpu.workarounds import ENGINE_ARGS, PATCHES, check, engine_args


def main(argv: Sequence[str]) -> int:
    if list(argv) == ["args"]:
        print(json.dumps(engine_args()))
        return 0
    if list(argv) == ["check"]:
        problems = check()
        print("\n".join(problems) or f"{len(ENGINE_ARGS)} engine arguments and {len(PATCHES)} patches hold")
        return 1 if problems else 0
    print(__doc__.strip(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
