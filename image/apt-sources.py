#!/usr/bin/env python3
"""Print a deb822 sources file for the image's Debian release, with the mirrors the host's apt already uses.

The build machine's apt sources (/etc/apt/sources.list and /etc/apt/sources.list.d/*.list|*.sources) name the Debian
mirror this machine is allowed to reach; the image uses the same URIs, never a hard-coded host. The archive entry
(suites without "-security") gives ``SUITE SUITE-updates``, the security entry ``SUITE-security``. Entries that are
not Debian's archive (third-party repositories, other distributions) are skipped: a candidate must carry the ``main``
component and serve a Debian suite (a codename with or without -updates/-security/-backports) from a path ending in
/debian or /debian-security.

Usage: apt-sources.py [--suite bookworm] [--root /] [--components "main non-free-firmware"]
(exit 1 with a message when no Debian mirror is configured)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

_SUITE = re.compile(r"^[a-z]+(-updates|-security|-backports|/updates)?$")


def _entries(root: Path) -> list[tuple[list[str], list[str], list[str]]]:
    """(URIs, suites, components) of every enabled ``deb`` entry."""
    out: list[tuple[list[str], list[str], list[str]]] = []
    apt = root / "etc/apt"
    files = [apt / "sources.list"] if (apt / "sources.list").is_file() else []
    files += sorted(p for p in (apt / "sources.list.d").glob("*") if p.suffix in (".list", ".sources"))
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix == ".sources":
            for stanza in re.split(r"\n\s*\n", text):
                fields: dict[str, str] = {}
                key = ""
                for line in stanza.splitlines():
                    if line.startswith("#") or not line.strip():
                        continue
                    if line[0].isspace() and key:
                        fields[key] += " " + line.strip()
                        continue
                    key, _, value = line.partition(":")
                    key = key.strip().lower()
                    fields[key] = value.strip()
                if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes").lower() == "no":
                    continue
                out.append((fields.get("uris", "").split(), fields.get("suites", "").split(),
                            fields.get("components", "").split()))
        else:
            for line in text.splitlines():
                line = re.sub(r"\[[^]]*\]", "", line.split("#", 1)[0]).split()  # type: ignore[assignment]
                if len(line) >= 4 and line[0] == "deb":
                    out.append(([line[1]], [line[2]], list(line[3:])))
    return out


def mirrors(root: Path) -> tuple[str | None, str | None]:
    """(archive URI, security URI) from the host's apt sources."""
    archive = security = None
    for uris, suites, components in _entries(root):
        if "main" not in components or not suites or not all(_SUITE.match(s) for s in suites):
            continue
        for uri in uris:
            path = uri.rstrip("/")
            if any("security" in s for s in suites) and path.endswith("/debian-security"):
                security = security or path
            elif not any("security" in s for s in suites) and path.endswith("/debian"):
                archive = archive or path
    return archive, security


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default="bookworm")
    parser.add_argument("--root", default="/", help="read the apt sources of this root (default /)")
    parser.add_argument("--components", default="main",
                        help='the image\'s components (default "main"; the arm64 image adds "non-free-firmware" for '
                             "raspi-firmware)")
    args = parser.parse_args()
    archive, security = mirrors(Path(args.root))
    if archive is None:
        print("apt-sources.py: no Debian archive mirror in the host's apt sources; add one (a 'deb' entry for "
              ".../debian with component main)", file=sys.stderr)
        return 1
    keyring = "/usr/share/keyrings/debian-archive-keyring.gpg"
    print(f"Types: deb\nURIs: {archive}\nSuites: {args.suite} {args.suite}-updates\nComponents: {args.components}\n"
          f"Signed-By: {keyring}")
    if security:
        print(f"\nTypes: deb\nURIs: {security}\nSuites: {args.suite}-security\nComponents: {args.components}\n"
              f"Signed-By: {keyring}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
