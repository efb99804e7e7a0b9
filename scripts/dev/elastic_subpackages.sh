#!/usr/bin/env bash
# megadyn/elastic in subpackages that name the spine (issue 37):
#
#   reshard/    description, regions, plan (was planner.py), executor, hetero_description
#   planning/   layouts (was layout_planner.py), hetero (hetero_planner.py), lengths
#               (length_planner.py), templates, requests, hetero_job, straggler_rebalance
#   control/    channel (control.py), records, drain, controller, protocol, events,
#               stragglers (scores), straggler_action
#   recovery/   agreement, decision (recovery_decision.py), recovery, watched_store,
#               rng_handover, retired_groups
#   transition.py and config.py stay at the top.
#
# Run from the repository root on a tree with the flat layout (it stops when the move is done
# already): it moves the files with git mv and rewrites every import, dotted name and path
# (megadyn.elastic.X, from megadyn.elastic import X, megadyn/elastic/X.py, and X.py inside
# megadyn/elastic) in megadyn/, tools/, tests/, scripts/, docs/ and pretrain_gpt.py.
# Re-run it after merging branches that still use the flat names.
set -euo pipefail

cd "$(git rev-parse --show-toplevel)"
if [ ! -e megadyn/elastic/controller.py ]; then
    echo "megadyn/elastic is in subpackages already" >&2
    exit 0
fi

MOVES="
description reshard/description
regions reshard/regions
planner reshard/plan
executor reshard/executor
hetero_description reshard/hetero_description
layout_planner planning/layouts
hetero_planner planning/hetero
length_planner planning/lengths
templates planning/templates
requests planning/requests
hetero_job planning/hetero_job
straggler_rebalance planning/straggler_rebalance
control control/channel
records control/records
drain control/drain
controller control/controller
protocol control/protocol
events control/events
stragglers control/stragglers
straggler_action control/straggler_action
agreement recovery/agreement
recovery_decision recovery/decision
recovery recovery/recovery
watched_store recovery/watched_store
rng_handover recovery/rng_handover
retired_groups recovery/retired_groups
"

declare -A DOC=(
    [reshard]="What moves in a change of layout: the training state's description, the reshard plan between two descriptions, and the executor that moves the tensors."
    [planning]="Which layout to run: the layout planner (a grid for a member count), the template planner (pipelines of different depth), the length planner (a layout per sequence length), and operator requests resolved into layouts."
    [control]="The controller at the step boundary: the control channel (the store of requests and epochs), its records, drains, the controller, the trainer protocol it needs, and the events it reports."
    [recovery]="A failed or hung worker: the survivors agree (agreement, decision), rebuild in-process (recovery), watch the failure records while connecting, hand over RNG streams and retire old groups."
)

# git mv, after the recovery module leaves the name its package takes
git mv megadyn/elastic/recovery.py megadyn/elastic/recovery_module.py
for sub in reshard planning control recovery; do
    mkdir -p "megadyn/elastic/$sub"
    printf '"""%s"""\n' "${DOC[$sub]}" | fold -s -w 96 | sed 's/ *$//' > "megadyn/elastic/$sub/__init__.py"
    git add "megadyn/elastic/$sub/__init__.py"
done
while read -r old new; do
    [ -z "$old" ] && continue
    src="megadyn/elastic/$old.py"
    [ "$old" = recovery ] && src=megadyn/elastic/recovery_module.py
    git mv "$src" "megadyn/elastic/$new.py"
done <<< "$MOVES"

# rewrite every reference, in one pass per file (no name is rewritten twice)
MOVES="$MOVES" python3 - <<'EOF'
import os
import re
import subprocess

moves = dict(line.split() for line in os.environ["MOVES"].strip().splitlines())
names = "|".join(sorted(moves, key=len, reverse=True))
dotted = re.compile(rf"\bmegadyn\.elastic\.({names})\b")
path = re.compile(rf"\belastic/({names})\.py\b")
bare = re.compile(rf"(?<![\w/.])({names})\.py\b")
from_import = re.compile(r"^(\s*)from megadyn\.elastic import ([\w, ]+?)(\s*#.*)?$", re.M)


def split_import(m: re.Match) -> str:
    """`from megadyn.elastic import a, b`: moved modules from their subpackage."""
    indent, names_, comment = m.group(1), m.group(2), m.group(3) or ""
    kept, lines = [], []
    for name in (n.strip() for n in names_.split(",")):
        if name not in moves:
            kept.append(name)
            continue
        package, module = moves[name].split("/")
        alias = "" if module == name else f" as {name}"
        lines.append(f"{indent}from megadyn.elastic.{package} import {module}{alias}{comment}")
    if kept:
        lines.insert(0, f"{indent}from megadyn.elastic import {', '.join(kept)}{comment}")
    return "\n".join(lines)


def dotted_name(m: re.Match) -> str:
    return "megadyn.elastic." + moves[m.group(1)].replace("/", ".")


files = subprocess.run(
    ["git", "ls-files", "megadyn", "tools", "tests", "scripts", "docs", "pretrain_gpt.py"],
    check=True, capture_output=True, text=True,
).stdout.split()
for name in files:
    if not name.endswith((".py", ".md", ".sh", ".txt", ".toml", ".cfg")) or not os.path.isfile(name):
        continue
    if name == "scripts/dev/elastic_subpackages.sh":
        continue
    text = open(name, encoding="utf-8").read()
    new = dotted.sub(dotted_name, text)  # first: the lines split_import writes are final
    new = from_import.sub(split_import, new)
    new = path.sub(lambda m: f"elastic/{moves[m.group(1)]}.py", new)
    if name.startswith("megadyn/elastic/"):  # a sibling named by its file
        new = bare.sub(lambda m: f"{moves[m.group(1)]}.py", new)
    if new != text:
        open(name, "w", encoding="utf-8").write(new)

# the package's map, in its docstring
init = "megadyn/elastic/__init__.py"
text = open(init, encoding="utf-8").read()
first = '"""Elastic training: the training-state description, the reshard planner and its executor.\n'
package_map = '''"""Elastic training: every change of layout is one transition, plan -> move -> rebuild.

    transition.py  the spine: a Transition and the one function that runs it
    config.py      ElasticConfig, and what elastic reads of the job's config
    control/       the step boundary: channel, records, drains, controller, events
    planning/      which layout: layouts, hetero (the templates' planner), lengths, requests
    recovery/      a failed worker: agreement, decision, recovery, watched store
    reshard/       what moves: description, plan, executor

This package exports the reshard's names:
'''
if text.startswith(first):
    open(init, "w", encoding="utf-8").write(package_map + text[len(first):])
EOF

git add -A megadyn tools tests scripts docs pretrain_gpt.py
changed=$(git diff --cached --name-only --diff-filter=AMR -- '*.py')
ruff check --fix --quiet --select I,F401 $changed || true  # imports the rewrite reordered
ruff format --quiet $changed
git add -A megadyn tools tests scripts docs pretrain_gpt.py
echo "megadyn/elastic: moved into reshard/, planning/, control/ and recovery/; review with git diff --cached"
