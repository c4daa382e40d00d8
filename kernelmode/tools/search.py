"""Tool discovery by intent: BM25 (``bm25s``) over tools' names, descriptions and parameters.

With hundreds of tools (several upstream MCP servers), listing them all costs the context that
code mode exists to save; ``search_tools`` answers the few that fit an intent instead.

A tool is one document of fields weighted by repetition: its name (split at ``_``, ``.``, ``-``
and camelCase; three times), its parameters' names (twice), its description's first line (twice
with the whole description), its server's name and its parameters' descriptions (once). Words are
lower-cased, stop words dropped, and stemmed (Snowball, ``PyStemmer``), so "commits" finds
``list_commits``. A query's words also bring in
their common synonyms (``_SYNONYM_GROUPS``, at half weight): an agent says "remove" where a tool
says "delete". Last, a tool gains in proportion to the share of its name's words the query says
(half for a synonym): BM25 alone prefers short documents that repeat one of the query's words.

An index is built for a set of tools and kept (a few, least recently used first out); a changed
tool set (an upstream server reconnected with other tools) or another allow-list is another set,
so the index is rebuilt when the tools change, and a session's search never ranks, nor lets its
scores depend on, tools it may not call.
"""

from __future__ import annotations

import functools
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import InvalidRequest
from .base import ToolInfo, ToolMatch

if TYPE_CHECKING:
    import numpy as np

__all__ = ["MAX_LIMIT", "MAX_QUERY_CHARS", "ToolMatch", "ToolSearch", "check_query", "tokens", "tool_limit"]

MAX_LIMIT = 50
MAX_QUERY_CHARS = 1_000
_NAME_WEIGHT, _PARAM_WEIGHT = 3, 2
_SYNONYM_WEIGHT = 0.5
_NAME_BONUS = 0.5  # times the best BM25 score, for a name the query says whole
_KEEP_INDEXES = 8

# Not English stop words though in bm25s's NLTK-like list: they name things tools do ("mouse
# up", "all cookies", "before a date"); and words that are, the padding of requests ("please").
_KEEP_WORDS = {"up", "down", "all", "off", "out", "on", "over", "under", "before", "after", "no", "not", "same",
               "again"}
_PADDING = ("please need needs want wants using via can could would may might also everything something "
            "anything some still several whats let lets").split()

# Words an agent and a tool description use for the same thing (stems after the stemmer).
_SYNONYM_GROUPS = [
    # verbs
    "get fetch retrieve read show view obtain load lookup",
    "list enumerate browse all",
    "search find query lookup look locate grep",
    "create make new add open start",
    "delete remove erase drop destroy trash forget purge",
    "update edit modify change set alter patch",
    "send post write publish",
    "save store write put persist cache",
    "run execute invoke call trigger",
    "type enter input fill",
    "click press tap",
    "navigate go visit goto browse open",
    "convert translate transform",
    "comment reply respond answer",
    "move rename",
    "copy duplicate clone",
    "close resolve archive dismiss",
    "download fetch",
    "upload attach",
    "approve accept review",
    "stage add",
    "unstage reset",
    "switch checkout",
    "remember memorize know knowledge memory",
    # nouns, and the short forms people type
    "repo repository",
    "pr pull merge",
    "org organization organisation",
    "dir directory folder",
    "file document doc",
    "doc documentation docs manual guide",
    "config configuration settings setting",
    "info information details detail metadata",
    "env environment",
    "db database table sql",
    "js javascript script",
    "url link page website site web",
    "web internet online google",
    "message chat post msg",
    "user member person people account",
    "team group",
    "issue ticket bug",
    "error exception crash failure",
    "screenshot capture",
    "image picture photo media",
    "popup dialog alert modal prompt",
    "time clock date",
    "timezone zone tz",
    "coordinate latitude longitude geocode location position",
    "address location place",
    "elevation altitude height high",
    "outage anomaly disruption downtime incident",
    "entity node",
    "relation relationship edge link",
    "note observation memo",
    "schedule calendar meeting event",
    "email mail",
    "star favorite bookmark",
    "snippet gist",
    "tree structure hierarchy",
    "size big large",
    "log logs output console",
]


_stem_lock = threading.Lock()  # PyStemmer's stemmer objects are not thread-safe
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_WORD = re.compile(r"[a-z0-9]+")


@functools.cache
def _lexicon() -> tuple[frozenset[str], Any]:
    """(stop words, the stemmer), loaded at the first search: bm25s and PyStemmer (numpy with
    them) are ~80 ms of imports that a server's start, and the stdio MCP server's first answer,
    need not wait for."""
    import Stemmer
    from bm25s.stopwords import STOPWORDS_EN_PLUS

    return (frozenset(STOPWORDS_EN_PLUS) - _KEEP_WORDS) | frozenset(_PADDING), Stemmer.Stemmer("english")


def _words(text: str) -> list[str]:
    stop = _lexicon()[0]
    return [w for w in _WORD.findall(_CAMEL.sub(" ", text).lower()) if w not in stop]


def tokens(text: str) -> list[str]:
    """The stems of ``text``'s words: snake_case and camelCase split, stop words out."""
    words = _words(text)
    with _stem_lock:
        return list(_lexicon()[1].stemWords(words)) if words else []


@functools.cache
def _synonyms() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for group in _SYNONYM_GROUPS:
        stems = set(tokens(group))
        for s in stems:
            out.setdefault(s, set()).update(stems - {s})
    return out


def _one_line(text: str, limit: int = 200) -> str:
    line = next((x.strip() for x in text.splitlines() if x.strip()), "")
    return line if len(line) <= limit else line[: limit - 1].rstrip() + "…"


def _document(info: ToolInfo) -> list[str]:
    """The weighted bag of stems that stands for one tool."""
    local = info.name.rsplit(".", 1)[-1]
    props = (info.parameters or {}).get("properties")
    props = props if isinstance(props, dict) else {}
    param_names = " ".join(props)
    param_text = " ".join(str(p.get("description", "")) for p in props.values() if isinstance(p, dict))
    out = tokens(local) * _NAME_WEIGHT + tokens(info.namespace or "") + tokens(param_names) * _PARAM_WEIGHT
    # The first line is the summary; the rest often holds examples and hints that mention much else.
    return out + tokens(_one_line(info.description, 10_000)) + tokens(info.description) + tokens(param_text)


def check_query(query: object, limit: object) -> tuple[str, int]:
    """The query and limit as given by a front door, or InvalidRequest saying what is wrong."""
    if not isinstance(query, str) or not query.strip():
        raise InvalidRequest("query must be a non-empty text, e.g. 'list the commits of a repository'")
    if len(query) > MAX_QUERY_CHARS:
        raise InvalidRequest(f"query is {len(query)} characters, over the limit of {MAX_QUERY_CHARS}")
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise InvalidRequest(f"limit must be an integer from 1 to {MAX_LIMIT}, not {limit!r}")
    return query, limit


def tool_limit(raw: str | None, default: int = 8) -> int:
    """A limit given as text (a query string's), or InvalidRequest."""
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise InvalidRequest(f"limit must be an integer from 1 to {MAX_LIMIT}, not {raw[:40]!r}") from None


_Key = tuple[str, str, str]
_DOC_CACHE: dict[_Key, list[str]] = {}  # stemming is most of an index's cost: a tool is stemmed once
_DOC_CACHE_MAX = 50_000


def _key(info: ToolInfo) -> _Key:
    return info.name, info.description, info.signature


def _cached_document(info: ToolInfo) -> list[str]:
    key = _key(info)
    doc = _DOC_CACHE.get(key)
    if doc is None:
        if len(_DOC_CACHE) >= _DOC_CACHE_MAX:
            _DOC_CACHE.clear()
        doc = _DOC_CACHE[key] = _document(info) or [""]
    return doc


class _Index:
    """BM25 over one set of tools, and each tool's name as a set of stems."""

    def __init__(self, infos: Sequence[ToolInfo]) -> None:
        self.infos = list(infos)
        import bm25s

        docs = [_cached_document(i) for i in self.infos]
        self.bm25 = bm25s.BM25()
        self.bm25.index(docs, show_progress=False)
        self.vocab: dict[str, int] = self.bm25.vocab_dict
        self.names = [frozenset(tokens(i.name.rsplit(".", 1)[-1])) for i in self.infos]

    def _scores(self, stems: list[str]) -> np.ndarray | None:
        ids = [self.vocab[s] for s in stems if s in self.vocab]
        return self.bm25.get_scores_from_ids(ids) if ids else None

    def rank(self, query: str, limit: int) -> list[ToolMatch]:
        import numpy as np

        stems = list(dict.fromkeys(tokens(query)))
        synonyms = _synonyms()
        extra = list(dict.fromkeys(s for q in stems for s in sorted(synonyms.get(q, ())) if s not in stems))
        total = np.zeros(len(self.infos), dtype=np.float64)
        for part, weight in ((stems, 1.0), (extra, _SYNONYM_WEIGHT)):
            scores = self._scores(part)
            if scores is not None:
                total += weight * scores
        best = float(total.max()) if len(total) else 0.0
        if best > 0:
            # A tool whose whole name the query says ("list ... commits": list_commits) goes up:
            # BM25 alone favours short documents that repeat one query word.
            said, near = set(stems), set(extra)
            cover = np.array([(len(n & said) + _SYNONYM_WEIGHT * len((n - said) & near)) / len(n) if n else 0.0
                              for n in self.names])
            total += _NAME_BONUS * best * cover * (total > 0)
        top = np.argsort(-total, kind="stable")[:limit]
        return [ToolMatch(name=self.infos[i].name, description=_one_line(self.infos[i].description),
                          signature=self.infos[i].signature, score=round(float(total[i]), 3))
                for i in top if total[i] > 0]


class ToolSearch:
    """Ranks a set of tools for an intent; keeps the indexes of the last few sets it saw."""

    def __init__(self, keep: int = _KEEP_INDEXES) -> None:
        self._keep = keep
        self._indexes: OrderedDict[tuple[_Key, ...], _Index] = OrderedDict()
        self._lock = threading.Lock()

    def search(self, infos: Sequence[ToolInfo], query: str, limit: int = 8) -> list[ToolMatch]:
        """The at most ``limit`` tools of ``infos`` that best fit ``query``, best first."""
        query, limit = check_query(query, limit)
        if not infos:
            return []
        return self._index(infos).rank(query, limit)

    def _index(self, infos: Sequence[ToolInfo]) -> _Index:
        key = tuple(_key(i) for i in infos)
        with self._lock:
            index = self._indexes.get(key)
            if index is not None:
                self._indexes.move_to_end(key)
                return index
        index = _Index(infos)  # built outside the lock: two builders of one set both finish
        with self._lock:
            self._indexes[key] = index
            while len(self._indexes) > self._keep:
                self._indexes.popitem(last=False)
        return index
