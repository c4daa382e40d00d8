"""Which packages may be installed: requirement parsing, ``packages.allow`` / ``deny`` rules, and
the per-tenant rate of install requests.

A rule is a name (``requests``), a glob on the name (``django-*``) or a name with version
specifiers (``numpy<3``). Names are compared normalized (PEP 503: ``Foo_Bar`` is ``foo-bar``).
Rules are checked on what is asked for and again on everything the resolver picked (a denied
package cannot come in as a dependency).
"""

from __future__ import annotations

import fnmatch
import re
import time
from collections import deque
from dataclasses import dataclass, field

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from ..errors import InvalidRequest, PackageRefused, QuotaExceeded

MAX_REQUIREMENT_CHARS = 200
_RULE = re.compile(r"^\s*([A-Za-z0-9*?._\[\]-]+)\s*(.*)$")
INDEX_ONLY = "index_names_only"
# pip opens a requirement as a FILE of its working directory when it ends like one of these
# (pip's ARCHIVE_EXTENSIONS, compared without case) and such a file exists: it would then run
# the archive's build backend on the host, --only-binary notwithstanding.
ARCHIVE_SUFFIXES = (".whl", ".zip", ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz", ".tar.xz", ".txz",
                    ".tlz", ".tar.lz", ".tar.lzma")
# The same, anywhere a name could end (before extras, a specifier, a marker, a fragment...).
_ARCHIVE_IN_TEXT = re.compile("(" + "|".join(re.escape(s) for s in ARCHIVE_SUFFIXES) + r")(?=$|[\s\[\];#=<>!~,()])",
                              re.IGNORECASE)


def _not_from_index(text: str, what: str) -> PackageRefused:
    return PackageRefused(f"{text[:80]!r} could be read by pip as {what}: only package names from the "
                          f"configured index can be installed (rule: {INDEX_ONLY}); ask for the name, "
                          "like 'name', 'name==1.2' or 'name[extra]>=1,<2'",
                          details={"rule": INDEX_ONLY, "package": text[:80]})


def parse_requirement(text: str) -> Requirement:
    """A requirement as pip reads it, but only from an index: a name, extras and version
    specifiers; anything pip could take for an option, a path, a URL or an archive is refused
    (PackageRefused, rule ``index_names_only``) before pip ever sees it."""
    if not isinstance(text, str) or not text.strip() or len(text) > MAX_REQUIREMENT_CHARS:
        raise InvalidRequest(f"not a package requirement: {str(text)[:80]!r} (1-{MAX_REQUIREMENT_CHARS} "
                             "characters, like 'name', 'name==1.2' or 'name>=1,<2')")
    text = text.strip()
    if text.startswith("-"):
        raise _not_from_index(text, "an option")
    if text.startswith(".") or "/" in text or "\\" in text:
        raise _not_from_index(text, "a path")
    if ":" in text or "@" in text:
        raise _not_from_index(text, "a URL")
    if _ARCHIVE_IN_TEXT.search(text):
        raise _not_from_index(text, "an archive file")
    try:
        req = Requirement(text)
    except InvalidRequirement as e:
        raise InvalidRequest(f"not a package requirement: {text!r} ({e})") from None
    if req.url is not None:  # unreachable after the checks above; never trust it blindly
        raise _not_from_index(text, "a URL")
    if req.name.lower().endswith(ARCHIVE_SUFFIXES):
        raise _not_from_index(text, "an archive file")
    if req.marker is not None:
        raise InvalidRequest(f"{text!r}: environment markers are not accepted")
    return req


@dataclass(frozen=True)
class Rule:
    """One allow/deny entry."""

    text: str
    pattern: str  # normalized name or glob
    specifier: SpecifierSet

    @classmethod
    def parse(cls, text: str) -> Rule:
        m = _RULE.match(text)
        if not m:
            raise ValueError(f"bad package rule {text!r}")
        name, spec = m.group(1), m.group(2).strip()
        pattern = name if any(c in name for c in "*?[") else canonicalize_name(name)
        return cls(text, pattern.lower().replace("_", "-").replace(".", "-"), SpecifierSet(spec))

    def matches_name(self, name: str) -> bool:
        return fnmatch.fnmatchcase(canonicalize_name(name), self.pattern)

    def matches(self, name: str, version: str | None) -> bool:
        """Whether the rule covers this package (any version when ``version`` is None)."""
        if not self.matches_name(name):
            return False
        if version is None or not str(self.specifier):
            return True
        return self.specifier.contains(version, prereleases=True)


@dataclass
class PackagePolicy:
    allow: list[Rule] | None
    deny: list[Rule]

    @classmethod
    def from_lists(cls, allow: list[str] | None, deny: list[str]) -> PackagePolicy:
        return cls([Rule.parse(a) for a in allow] if allow is not None else None,
                   [Rule.parse(d) for d in deny])

    def check(self, name: str, version: str | None = None, why: str = "") -> None:
        """Raise PackageRefused naming the rule that refuses ``name`` (at ``version``)."""
        label = f"{name}{'==' + version if version else ''}{why}"
        for rule in self.deny:
            if rule.matches(name, version):
                raise PackageRefused(f"{label} is refused by the rule packages.deny: {rule.text!r}",
                                     details={"package": name, "rule": f"deny: {rule.text}"})
        if self.allow is None:
            return
        named = [r for r in self.allow if r.matches_name(name)]
        if not named:
            raise PackageRefused(f"{label} is not in packages.allow (allowed: "
                                 f"{', '.join(r.text for r in self.allow) or 'nothing'})",
                                 details={"package": name, "rule": "allow"})
        if version is not None and not any(r.matches(name, version) for r in named):
            raise PackageRefused(f"{label} is outside the versions packages.allow permits: "
                                 f"{', '.join(r.text for r in named)}",
                                 details={"package": name, "rule": f"allow: {named[0].text}"})


@dataclass
class TenantRate:
    """At most ``per_minute`` install requests per tenant in any sliding minute."""

    per_minute: int
    _seen: dict[str, deque[float]] = field(default_factory=dict)

    def take(self, tenant: str) -> None:
        now = time.monotonic()
        q = self._seen.setdefault(tenant, deque())
        while q and q[0] <= now - 60:
            q.popleft()
        if len(q) >= self.per_minute:
            wait = max(1, round(60 - (now - q[0])))
            raise QuotaExceeded(f"package installs: at most {self.per_minute} a minute for this tenant "
                                f"(packages.installs_per_minute); retry in {wait} s",
                                details={"retry_after_seconds": wait})
        q.append(now)
