"""The docs' front page (docs/index.md) shares its sections with README.md:
the introduction, the headline numbers and the reading list, each between
`<!-- front: NAME -->` and `<!-- /front -->` in both files. README is the
source; this writes its sections into docs/index.md with the links made
relative to docs/ (`docs/x.md` -> `x.md`). tests/test_docs.py fails when
the two differ.

    python3 tools/front_page.py          # rewrite docs/index.md's shared sections
    python3 tools/front_page.py --check  # exit 1 when they differ
"""

from __future__ import annotations

import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = re.compile(r"<!-- front: (?P<name>[a-z-]+) -->\n(?P<body>.*?)<!-- /front -->", re.S)


def sections(text: str) -> dict[str, str]:
    """The shared sections of a page, by name."""
    return {m["name"]: m["body"] for m in SECTION.finditer(text)}


def as_docs_page(body: str) -> str:
    """README's text as docs/index.md reads it: links into docs/ relative to docs/."""
    return re.sub(r"\]\(docs/", "](", body)


def front_page(readme: str, index: str) -> str:
    """docs/index.md with each shared section replaced by README's."""
    theirs = sections(readme)
    missing = set(sections(index)) - set(theirs)
    if missing:
        raise SystemExit(f"docs/index.md shares sections README.md lacks: {sorted(missing)}")
    return SECTION.sub(lambda m: f"<!-- front: {m['name']} -->\n{as_docs_page(theirs[m['name']])}<!-- /front -->",
                       index)


def main(argv: list[str]) -> int:
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    path = os.path.join(REPO, "docs", "index.md")
    with open(path) as f:
        index = f.read()
    want = front_page(readme, index)
    if "--check" in argv:
        if want != index:
            print("docs/index.md differs from README.md's shared sections: run python3 tools/front_page.py",
                  file=sys.stderr)
            return 1
        return 0
    with open(path, "w") as f:
        f.write(want)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
