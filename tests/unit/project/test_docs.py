"""The documentation cannot drift from the code it describes.

* The mapping reference (docs/mapping.md, "Every key") documents exactly the keys
  that transforms/mapping.schema.json defines: none missing, none invented.
* Code cites the correctness contract as ``docs/design.md §N``, and every cited
  section exists (the old "design notes §1" / "contract §1" pointed at a document
  outside the repository).
* The README's first screen has the two set-up commands.
* The site builds with ``mkdocs build --strict`` (broken links and anchors fail).
"""
from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs"
SCHEMA_PATH = ROOT / "transforms" / "mapping.schema.json"
MAPPING_PAGE = DOCS / "mapping.md"
DESIGN_PAGE = DOCS / "design.md"

# How a map whose keys the user chooses is written in a documented path:
# families.<family>.max_versions, rules[].columns.<attribute>.encoding.
PLACEHOLDERS = {"families": "<family>", "columns": "<attribute>"}
KEY_SECTION = "## Every key"


# --- the mapping reference against the schema ---------------------------------


def schema_keys(schema: dict) -> set:
    """Every key the schema defines, as a dotted path (``rules[].indexes[].name``).

    Walks properties, maps (``additionalProperties`` objects), list items and the
    branches of oneOf/anyOf/allOf, following ``$ref`` into ``$defs``. A definition
    used in two places (a match condition in a rule and in an index) is expanded
    at its first use only; the second use is documented as its key alone."""
    defs = schema.get("$defs", {})
    keys: set = set()
    expanded: set = set()

    def walk(node, path: str) -> None:
        if not isinstance(node, dict):
            return
        ref = node.get("$ref")
        if ref is not None:
            name = ref.rsplit("/", 1)[-1]
            if name not in defs:
                raise AssertionError(f"schema: {ref} does not resolve")
            if name in expanded:
                return
            expanded.add(name)
            walk(defs[name], path)
        for combinator in ("oneOf", "anyOf", "allOf"):
            for branch in node.get(combinator, []):
                walk(branch, path)
        for key, sub in node.get("properties", {}).items():
            child = f"{path}.{key}" if path else key
            keys.add(child)
            walk(sub, child)
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            last = path.rsplit(".", 1)[-1]
            child = f"{path}.{PLACEHOLDERS.get(last, '<name>')}"
            keys.add(child)
            walk(extra, child)
        items = node.get("items")
        if isinstance(items, dict):
            walk(items, f"{path}[]")

    walk(schema, "")
    return keys


def documented_keys(markdown: str) -> set:
    """The keys in the first column of the tables under "## Every key"."""
    start = markdown.find("\n" + KEY_SECTION + "\n")
    assert start >= 0, f"docs/mapping.md has no '{KEY_SECTION}' section"
    rest = markdown[start + len(KEY_SECTION) + 2:]
    end = rest.find("\n## ")
    section = rest if end < 0 else rest[:end]
    return set(re.findall(r"^\|\s*`([^`]+)`\s*\|", section, flags=re.MULTILINE))


def drift(schema: dict, markdown: str) -> tuple:
    """(keys the schema defines that the page does not document,
        keys the page documents that the schema does not define)."""
    in_schema, on_page = schema_keys(schema), documented_keys(markdown)
    return sorted(in_schema - on_page), sorted(on_page - in_schema)


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def mapping_page() -> str:
    return MAPPING_PAGE.read_text(encoding="utf-8")


def test_the_schema_walk_reaches_nested_definitions(schema):
    keys = schema_keys(schema)
    # top level, a nested object, a map's values, a list's $ref'd items, a oneOf
    # branch inside a $ref, and a $ref reached through another $ref
    for key in ("version", "source.key.partition", "families.<family>.gc", "rules[].row_key",
                "rules[].columns.<attribute>.timestamp.format", "rules[].match.regex",
                "rules[].indexes[].project", "rules[].indexes[].match"):
        assert key in keys
    assert len(keys) >= 50


def test_every_schema_key_is_documented_in_the_mapping_reference(schema, mapping_page):
    missing, _ = drift(schema, mapping_page)
    assert not missing, f"keys of mapping.schema.json missing from docs/mapping.md '{KEY_SECTION}': {missing}"


def test_every_documented_key_exists_in_the_schema(schema, mapping_page):
    _, unknown = drift(schema, mapping_page)
    assert not unknown, f"docs/mapping.md documents keys mapping.schema.json does not define: {unknown}"


def test_removing_a_documented_key_is_caught(schema, mapping_page):
    """The check has teeth: drop any one key's row from the page, and that key is
    reported missing."""
    for key in sorted(documented_keys(mapping_page)):
        row = re.compile(r"^\|\s*`" + re.escape(key) + r"`\s*\|.*\n", flags=re.MULTILINE)
        trimmed, count = row.subn("", mapping_page, count=1)
        assert count == 1
        missing, unknown = drift(schema, trimmed)
        assert missing == [key] and not unknown, key


def test_a_key_removed_from_the_schema_is_caught(schema, mapping_page):
    """...and the other direction: a key the schema no longer defines but the page
    still documents is reported."""
    smaller = copy.deepcopy(schema)
    del smaller["$defs"]["index"]["properties"]["project"]
    missing, unknown = drift(smaller, mapping_page)
    assert not missing and unknown == ["rules[].indexes[].project"]


# --- citations of the correctness contract -------------------------------------

CODE_DIRS = ("pipeline", "transforms")
CITED_DIRS = ("pipeline", "transforms", "examples", "tests", "bench", "deploy")
SECTION = re.compile(r"§\s*(\d+(?:\.\d+)*)")
OLD_CITATION = re.compile(r"design notes|contract §", flags=re.IGNORECASE)


def source_files(dirs) -> list:
    out = []
    for d in dirs:
        for path in sorted((ROOT / d).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".md", ".yaml", ".yml", ".sh", ".json", ".txt"):
                out.append(path)
    return out


def design_sections() -> set:
    """Section numbers of docs/design.md: '## 7. Backfill…' → '7', '### 7.3 …' → '7.3'."""
    text = DESIGN_PAGE.read_text(encoding="utf-8")
    return set(re.findall(r"^#{2,4}\s+(\d+(?:\.\d+)*)\.?\s", text, flags=re.MULTILINE))


def cited_sections(line: str) -> list:
    """The sections a line cites: every §N after its mention of docs/design.md
    ("docs/design.md §4 (per-row order) and §8" cites 4 and 8)."""
    at = line.find("docs/design.md")
    return [] if at < 0 else SECTION.findall(line[at:])


def test_code_no_longer_cites_the_old_design_notes():
    offenders = []
    for path in source_files(CODE_DIRS):
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if OLD_CITATION.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not offenders, "cite docs/design.md §N instead:\n" + "\n".join(offenders)


def test_every_design_citation_names_an_existing_section():
    sections = design_sections()
    citations, broken = 0, []
    for path in source_files(CITED_DIRS):
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for number in cited_sections(line):
                citations += 1
                if number not in sections:
                    broken.append(f"{path.relative_to(ROOT)}:{lineno}: §{number}")
    assert not broken, f"citations of sections docs/design.md does not have {sorted(sections)}:\n" + "\n".join(broken)
    # the code does cite the contract (the check above is not vacuous)
    assert citations >= 7


def test_the_citation_pattern_reads_every_cited_section():
    assert cited_sections("Correctness, per docs/design.md §4 (per-row order) and §8 (trimmed):") == ["4", "8"]
    assert cited_sections("(docs/design.md §3 and §5)") == ["3", "5"]
    assert cited_sections("docs/design.md §4.2, §7.3") == ["4.2", "7.3"]
    assert cited_sections("see §2 of something else") == []
    assert "9.9" not in design_sections()  # what a broken citation would name


def test_design_sections_are_numbered_in_order():
    text = DESIGN_PAGE.read_text(encoding="utf-8")
    top = [int(n) for n in re.findall(r"^## (\d+)\. ", text, flags=re.MULTILINE)]
    assert top == list(range(1, len(top) + 1)) and len(top) >= 8
    current = 0
    for level, number in re.findall(r"^(##|###) (\d+(?:\.\d+)?)\.? ", text, flags=re.MULTILINE):
        if level == "##":
            current, expected_sub = int(number), 1
        else:
            major, minor = (int(x) for x in number.split("."))
            assert (major, minor) == (current, expected_sub), f"### {number} under ## {current}"
            expected_sub += 1


# --- the front page and the site ------------------------------------------------


def test_readme_first_screen_has_the_two_setup_commands():
    first_screen = "\n".join((ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:25])
    assert "deploy/local/setup.sh && .venv/bin/ddb2bt demo" in first_screen
    assert "deploy/local/setup.sh && .venv/bin/python -m pytest" in first_screen


def test_the_site_builds_strictly(tmp_path):
    """What .ci/run runs: broken links, anchors, snippet paths or pages missing from
    the nav fail the build."""
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "design" / "index.html").is_file()


def test_version_clashes_on_kinesis_are_one_statement_in_every_page():
    # docs/mapping.md said clashes are never silent while docs/kinesis.md said the
    # later one overwrites there; the code (sink/guarded.py: no version registry
    # behind the guard, tested in test_ordering_guard_model.py) sides with kinesis.md.
    statement = ("not\n  detected as a `version_clash` on this path: the later one overwrites",
                 "not\ndetected as a `version_clash` on this path: the later one overwrites")
    mapping = (ROOT / "docs/mapping.md").read_text()
    section = mapping[mapping.index("### Version clashes"):]
    section = section[:section.index("\n## ")]
    assert "never lets\nthat pass silently" not in section
    assert any(s in (ROOT / "docs/kinesis.md").read_text() for s in statement)
    assert " ".join(statement[0].split()) in " ".join(section.split())
    assert "With a Kinesis source the later one overwrites" in " ".join((ROOT / "docs/design.md").read_text().split())


@pytest.mark.parametrize("page,least", [("docs/cutover.md", 10), ("docs/rollback.md", 5)])
def test_every_runbook_command_is_run_by_the_test_the_runbook_names(page, least):
    """A runbook's table (the cutover's, the way back's): each row's test exists,
    and its source runs each command of the row (as a CLI argument list:
    "migrate", "--restart", ...)."""
    import ast

    text = (ROOT / page).read_text()
    table = text.split("### The runbook, as tested", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in table.splitlines() if r.startswith("| ") and "`tests/" in r]
    assert len(rows) >= least
    for row in rows:
        commands = re.findall(r"`ddb2bt ([^`]+)`", row.split("|")[2])
        where = re.search(r"`(tests/[^`]+\.py)::(\w+)`", row).groups()
        tree = ast.parse((ROOT / where[0]).read_text())
        fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == where[1]), None)
        assert fn is not None, f"{where[0]}::{where[1]} does not exist"
        words = {n.value for n in ast.walk(fn) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        for command in commands:
            for word in command.split():
                assert word in words, f"{where[1]} does not run `ddb2bt {command}` ({word!r} never passed)"


# --- docs are for users: no work notes --------------------------------------------

# "issue 36", "Issues 16 and 36", "ticket #4", "PR 12": the project's own tracker,
# which a user of the docs cannot see; "#57" as GitHub writes a reference.
TRACKER_WORDS = re.compile(r"\b(?:issues?|tickets?|bugs?|PRs?|pull requests?)\s*#?\d+", re.I)
HASH_REFERENCE = re.compile(r"(?<![\w&/#])#\d+\b(?![-\w])")
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def tracker_references(text: str) -> list:
    prose = CODE.sub("", text)  # a value such as `#86751345` in an example is data
    return [m.group(0) for pattern in (TRACKER_WORDS, HASH_REFERENCE) for m in pattern.finditer(prose)]


def test_no_page_names_an_issue_number():
    """The docs and the README say what is so for a user; which issue moved what
    belongs in the commit log."""
    found = {str(page.relative_to(ROOT)): refs for page in [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]
             if (refs := tracker_references(page.read_text()))}
    assert not found, found


def test_the_issue_number_check_sees_the_usual_spellings():
    assert tracker_references("Since issue 36 the row runs twice; Issues 16 and #57; see PR 12.") == [
        "issue 36", "Issues 16", "PR 12", "#57"]
    assert tracker_references("[sizing](deploy-dataflow.md#7-sizing), `VideoComment#98765481`, §7.4, "
                              "&#8212;") == []
