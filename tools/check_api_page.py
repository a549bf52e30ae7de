"""Check the built API page for what a user should not see: private names, raw reST markup.

Raw reST shows on the page as literal text: a Sphinx role (``:func:`x```, ``:class:``,
...), an ``Example::`` block or a ``.. note::``. Docstrings use mkdocstrings
cross-references (``[`x`][pdist.x]``) and Google sections (``Example:``) instead.

Run after ``mkdocs build`` (``nox -s docs`` does): ``python tools/check_api_page.py site``.
"""

from __future__ import annotations

import html
import re
import sys
from pathlib import Path

# Public-looking members of Group that are pdist's own plumbing.
INTERNAL = ("peer_index", "header_transport", "lifetime", "transport(", "Lifetime", "KeptMemory")
# A Sphinx role as rendered text: ":func:" before the target's code span.
ROLE = re.compile(r":(?:py:)?(?:func|class|data|meth|attr|mod|exc|obj|const|ref|term):")
# A reST literal-block section header: "Example::", "Example (on 2 ranks)::".
LITERAL_SECTION = re.compile(r"\bExamples?\b[^\n:]*::")


def main(site: str) -> int:
    """Exit 1, listing what was found, when the page shows an internal name or raw markup."""
    page = (Path(site) / "api" / "index.html").read_text()
    page = re.sub(r"<script.*?</script>", "", page, flags=re.DOTALL)
    text = html.unescape(re.sub(r"<[^>]+>", " ", page))
    found = sorted(set(re.findall(r"(?<![\w.])_[a-z]\w*", text)))
    found += [name for name in INTERNAL if name in text]
    found += [".. note::"] if ".. note::" in text else []
    found += sorted(set(ROLE.findall(text)))
    found += sorted(set(LITERAL_SECTION.findall(text)))
    if found:
        print(f"the API page shows internals: {found}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "site"))
