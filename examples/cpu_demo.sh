#!/usr/bin/env bash
# bash examples/cpu_demo.sh
# The one-command CPU demo: synthetic world -> retrieval server -> tiny model -> SFT warm-up -> GRPO.
set -euo pipefail
echo "cpu_demo: not built yet — the RL trainer and the demo land with the later issues (trainer, SFT + demo)." >&2
echo "What runs today: the tests (see README.md), checkpoints_convert/, tools/." >&2
exit 0
