"""The README stays a newcomer's page: short, with a folder map that names every package of `megarl/`, links to
every page of docs/, the step's dataflow diagram and the two commands as CI and the quickstart run them.
(The Python API example is checked against examples/api_quickstart.py, and run, by tests/e2e/test_api.py.)"""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_BYTES = 12 * 1024  # status and evidence live in docs/ (docs/status.md, docs/benchmarks.md, ...)


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def test_readme_is_short():
    size = os.path.getsize(os.path.join(ROOT, "README.md"))
    assert size <= MAX_BYTES, f"README.md is {size} bytes (at most {MAX_BYTES}): move detail into docs/"


def test_folder_map_names_every_package():
    table = _readme().split("## Where things live", 1)[1].split("\n## ", 1)[0]
    packages = sorted(d for d in os.listdir(os.path.join(ROOT, "megarl"))
                      if os.path.isfile(os.path.join(ROOT, "megarl", d, "__init__.py")))
    missing = [p for p in packages if f"`megarl/{p}/`" not in table]
    assert not missing, f"README's folder map lacks megarl/{missing}"


def test_every_docs_page_is_linked():
    text = _readme()
    pages = sorted(p for p in os.listdir(os.path.join(ROOT, "docs")) if p.endswith(".md"))
    missing = [p for p in pages if f"(docs/{p})" not in text]
    assert not missing, f"README links no docs/{missing}"


def test_step_diagram_and_the_two_commands():
    text = _readme()
    diagram = re.search(r"```mermaid\n(.*?)```", text, re.S)
    assert diagram, "README has no mermaid diagram of a step"
    loop = ""
    for name in ("rl_trainer.py", "schedule.py"):  # the step body and where its rollout and weight push happen
        with open(os.path.join(ROOT, "megarl", "trainer", name)) as f:
            loop += f.read()
    for call in ("serving", "compute_log_probs", "compute_ref_log_probs", "compute_values", "score",
                 "update_critic", "update_actor", "push_weights"):
        assert call in diagram.group(1), f"the diagram lacks {call}"
        assert f".{call}(" in loop or f".{call}." in loop, f"the step no longer calls {call}: redraw the diagram"
    assert "bash launch/install_cpu.sh && .venv/bin/megarl quickstart --out runs/quickstart" in text
    assert "bash launch/install_cpu.sh --test && .venv/bin/python -m pytest -q" in text
