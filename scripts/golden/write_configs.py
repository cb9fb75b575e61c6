"""Write only the config files of every size/kind, as input for record_expected_keys.py (main venv).

.venv/bin/python scripts/golden/write_configs.py CKPT_ROOT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from s2s_daemon.tools import checkpoint_layout as layout


def main() -> int:
    root = Path(sys.argv[1])
    for size in layout.SIZES:
        for kind in layout.KINDS:
            d = root / f"{size}_{kind}"
            (d / "speech_tokenizer").mkdir(parents=True, exist_ok=True)
            (d / "config.json").write_text(json.dumps(layout.model_config(size, kind), indent=2))
            (d / "speech_tokenizer" / "config.json").write_text(
                json.dumps(layout.speech_tokenizer_config(size), indent=2)
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
