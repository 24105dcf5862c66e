"""README.md and docs/ stay true: every setting documented with its default and comment, the
Quickstart has exactly two commands, README's commands name settings, files and links that exist.

    python -m pytest tests/test_readme.py -q
"""
import os
import re

from tests.conftest import ROOT

SCRIPTS = ("train_dmd.py", "train_flux_kontext.py")


def read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def constants(path):
    names = []
    for line in read(path).splitlines():
        if line.startswith(("def ", "class ")):
            break
        m = re.match(r"^([A-Z][A-Z0-9_]*) = [^\n]*#", line)  # a setting: constant + its comment
        if m:
            names.append(m.group(1))
    return names


def test_every_constant_is_in_the_settings_doc():
    doc = read("docs/settings.md")
    for script in SCRIPTS:
        missing = [n for n in constants(script) if f"`{n}`" not in doc]
        assert not missing, f"{script}: constants missing from docs/settings.md: {missing}"


def test_constants_tables_are_generated_from_the_scripts():
    """Defaults and comments in docs/settings.md equal the scripts' (python tools/readme_constants.py)."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "readme_constants.py"), "--check"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_quickstart_has_two_commands():
    quick = read("README.md").split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    assert quick.count("```bash") == 2


def test_readme_is_short():
    assert len(read("README.md").splitlines()) <= 250


def test_readme_flags_are_the_scripts_settings():
    """Every --name in README's Kontext section and its diffusers table is a train_flux_kontext.py
    setting; every --name in the DMD2 section a train_dmd.py one."""
    readme = read("README.md")
    kontext = readme.split("## Kontext:", 1)[1].split("\n## ", 1)[0]
    diffusers_column = {m for row in kontext.splitlines() if row.startswith("| `--")
                        for m in re.findall(r"`--([a-z_0-9]+)", row.split("|")[1])}
    ours = {m for m in re.findall(r"--([a-z_0-9]+)", kontext)} - diffusers_column - {"nproc_per_node", "name"}
    settings = {n.lower() for n in constants("train_flux_kontext.py")}
    assert ours and ours <= settings, sorted(ours - settings)
    dmd = readme.split("## DMD2 on", 1)[1].split("\n## ", 1)[0]
    assert {m for m in re.findall(r"--([a-z_0-9]+)", dmd)} <= {n.lower() for n in constants("train_dmd.py")}


def test_readme_names_files_that_exist():
    readme = read("README.md")
    paths = set(re.findall(r"\b((?:recipes|demos|tools|docs|assets)/[\w./-]+\.(?:sh|py|md|png|sbatch))", readme))
    paths |= set(re.findall(r"\]\(((?:docs/)[\w./-]+)(?:#[\w-]+)?\)", readme))
    missing = [p for p in sorted(paths) if not os.path.exists(os.path.join(ROOT, p))]
    assert paths and not missing, missing
    tree = readme.split("## Files", 1)[1].split("```", 2)[1]
    for line in tree.strip().splitlines():
        name = line.split()[0]
        assert os.path.exists(os.path.join(ROOT, name.rstrip("/"))), name


def doc_pages():
    """Every docs page: docs/*.md and the family pages docs/families/*.md (paths relative to ROOT)."""
    import glob
    return sorted(os.path.relpath(f, ROOT) for pattern in ("docs/*.md", "docs/families/*.md")
                  for f in glob.glob(os.path.join(ROOT, pattern)))


def test_docs_links_resolve():
    for page in doc_pages():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", read(page)):
            if target.startswith("http"):
                continue
            assert os.path.exists(os.path.join(ROOT, os.path.dirname(page), target)), f"{page}: {target}"


FAMILY_PAGE_HEADINGS = ["what it is", "which checkpoint to fine-tune", "data", "commands and recipes", "what fits",
                        "fine-tune, then dmd2", "loading the exports", "demo"]


def test_every_family_has_its_page_with_the_fixed_headings():
    """docs/families/<name>.md for every name in families.NAMES, no page for a family that is not one, and each
    page's sections (## headings) the same, in the same order (docs/architecture.md, "Adding a family")."""
    import families
    pages = sorted(n[:-3] for n in os.listdir(os.path.join(ROOT, "docs", "families")) if n.endswith(".md"))
    assert pages == sorted(families.NAMES), pages
    for name in families.NAMES:
        sections, fenced = [], False
        for line in read(f"docs/families/{name}.md").splitlines():
            fenced ^= line.startswith("```")
            if not fenced and line.startswith("## "):
                sections.append(line[3:].strip().lower())
        assert sections == FAMILY_PAGE_HEADINGS, (name, sections)


def test_family_pages_show_every_export_kind():
    """Each family page's loading lines: a full export (from_pretrained of an export folder), a LoRA export
    (load_lora_weights) and the merged LoRA export (export_merged)."""
    import families
    for name in families.NAMES:
        text = read(f"docs/families/{name}.md")
        loading = text.split("## Loading the exports", 1)[1].split("\n## ", 1)[0]
        for kind in ("export\")", "load_lora_weights(", "export_merged"):
            assert kind in loading, (name, kind)


def test_recipes_pass_what_the_readme_says():
    """The Kontext LoRA command shown equals the recipe's effective step: rank 16, alpha 4, LR 1e-4."""
    recipe = read("recipes/kontext_lora.sh")
    for flag in ("--lora_rank=16", "--lora_alpha=4", "--lr=1e-4"):
        assert flag in recipe and flag in read("README.md"), flag


def headings(path):
    """A markdown file's headings, lower case (not the comment lines of its code blocks)."""
    found, fenced = [], False
    for line in read(path).splitlines():
        fenced ^= line.startswith("```")
        if not fenced and re.match(r"#{1,6} ", line):
            found.append(line.lstrip("#").strip().lower())
    return found


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def tracked_text_files():
    import subprocess
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [f for f in out.split()
            if f.endswith((".py", ".sh", ".md", ".sbatch")) and os.path.exists(os.path.join(ROOT, f))]


# `docs/x.md, "Section"`, `README's "Section"`, or unquoted inside brackets: `(README, Section)`
SECTION_REF = re.compile(r"\b(README|docs/(?:families/)?\w+\.md)"
                         r"(?:(?:, |'s )[\"“]([^\"”]+)[\"”]|, ([A-Z][\w ]+)\))")


def test_sections_named_in_code_and_docs_exist():
    """A comment or doc that sends the reader to `docs/x.md, "Section"` (or README's "Section") names a
    heading that exists; markdown links into a doc's #anchor land on a heading."""
    wrong = []
    for f in tracked_text_files():
        if f == "tests/test_readme.py":
            continue
        text = read(f)
        for doc, quoted, bare in SECTION_REF.findall(text):
            section = quoted or bare
            doc = "README.md" if doc == "README" else doc
            if not os.path.exists(os.path.join(ROOT, doc)) or \
                    not any(h.startswith(section.lower()) for h in headings(doc)):
                wrong.append(f"{f}: {doc}, \"{section}\"")
        if f.endswith(".md"):
            here = os.path.dirname(f)
            for target, anchor in re.findall(r"\]\(([\w./-]*\.md)#([\w-]+)\)", text):
                doc = os.path.normpath(os.path.join(here, target))
                if os.path.exists(os.path.join(ROOT, doc)) and anchor not in {slug(h) for h in headings(doc)}:
                    wrong.append(f"{f}: {target}#{anchor}")
    assert not wrong, "sections that do not exist:\n" + "\n".join(wrong)


def test_section_reference_pattern_catches_a_missing_section():
    assert SECTION_REF.findall('see (README, "No such section")') == [("README", "No such section", "")]
    assert SECTION_REF.findall("(README, No such section)") == [("README", "", "No such section")]
    assert not any("no such section" in h for h in headings("README.md"))


def test_readme_tables_name_every_family_and_doc():
    """The README's Files line for families/ names every room (families.FAMILIES, by its NAME), its Docs table
    links every docs/*.md and docs/families/*.md, and its Files block every folder of the repository: the next
    family or page cannot be left out."""
    import families
    text = read("README.md")
    rooms = [line for line in text.splitlines() if line.startswith("families/")]
    assert len(rooms) == 1 and all(room.NAME in rooms[0] for room in set(families.FAMILIES.values())), rooms
    docs = text[text.index("## Docs"):text.index("## Tests")]
    assert [f for f in doc_pages() if f"({f})" not in docs] == []
    files = text[text.index("## Files"):text.index("## Docs")]
    import subprocess
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    folders = sorted({p.split("/")[0] for p in tracked.splitlines() if "/" in p and not p.startswith(".")})
    assert folders and [d for d in folders if f"\n{d}/" not in files] == []
