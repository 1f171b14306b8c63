"""A frontend program's state: its text (or chat turns) and the variables its `gen` and
`select` calls filled. `s += item` runs the item at once, against the state's backend.

A program is either plain text or a chat: text appended outside a turn before any turn
is plain text; once a turn is used, text goes inside turns and each generation runs
inside an assistant turn, after the chat template's rendering of the turns before it.
Every generation's prompt extends the one before, so the server's radix cache reuses it.
"""

from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixserve.lang.backends import Backend, ChatTemplate
from radixserve.lang.primitives import (
    ROLES,
    Expr,
    Gen,
    Item,
    LangError,
    Role,
    Select,
    Seq,
    choices_regex,
)


class ProgramState:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.variables: dict[str, str] = {}
        # Per select variable: its choices' mean logprobs ("scores"), as SGLang's
        # get_meta_info gives its normalized prompt logprobs.
        self.meta: dict[str, dict[str, Any]] = {}
        self._text = ""  # plain text mode
        self._messages: list[dict[str, str]] = []  # chat mode: closed turns
        self._role: str | None = None  # the open turn
        self._content = ""  # the open turn's content so far

    @property
    def is_chat(self) -> bool:
        return bool(self._messages) or self._role is not None

    def __iadd__(self, item: Item) -> ProgramState:
        self._append(item)
        return self

    def __getitem__(self, name: str) -> str:
        try:
            return self.variables[name]
        except KeyError:
            known = ", ".join(sorted(self.variables)) or "none"
            raise KeyError(f"no variable {name!r} (this program has: {known})") from None

    def text(self) -> str:
        """The program so far as the model reads it (chat turns rendered)."""
        if not self.is_chat:
            return self._text
        return self._chat_template().render(self.messages(), generation=False)

    def messages(self) -> list[dict[str, str]]:
        """The chat turns so far, the open one included."""
        turns = [dict(m) for m in self._messages]
        if self._role is not None:
            turns.append({"role": self._role, "content": self._content})
        return turns

    def fork(self, n: int) -> ForkGroup:
        """`n` copies of this state that go on independently; `forks += item` runs the
        item on every copy at once (their shared prefix is cached once by the server)."""
        if n < 1:
            raise ValueError(f"fork needs n >= 1, got {n}")
        return ForkGroup(self._copy() for _ in range(n))

    def _copy(self) -> ProgramState:
        clone = copy.copy(self)  # the backend is shared
        clone.variables = dict(self.variables)
        clone.meta = dict(self.meta)
        clone._messages = [dict(m) for m in self._messages]
        return clone

    def _append(self, item: Item) -> None:
        if isinstance(item, str):
            self._append_text(item)
        elif isinstance(item, list | tuple):
            for part in item:
                self._append(part)
        elif isinstance(item, Seq):
            self._append(item.items)
        elif isinstance(item, Role):
            self._append_role(item)
        elif isinstance(item, Gen):
            self._generate(item.name, item.params)
        elif isinstance(item, Select):
            self._select(item)
        elif isinstance(item, Expr):
            raise LangError(f"cannot append {type(item).__name__}")
        else:
            raise TypeError(f"a program appends text, gen, select or a turn, not {item!r}")

    def _append_text(self, text: str) -> None:
        if self._role is not None:
            self._content += text
        elif self._messages:
            raise LangError("this program is a chat: put text inside a turn (user(...), ...)")
        else:
            self._text += text

    def _append_role(self, turn: Role) -> None:
        if turn.role not in ROLES:
            raise LangError(f"unknown role {turn.role!r}")
        if self._role is not None:
            raise LangError(f"a {turn.role} turn inside the open {self._role} turn")
        if self._text:
            raise LangError("this program began as plain text: it cannot have chat turns")
        self._role, self._content = turn.role, ""
        try:
            self._append(turn.content)
        finally:
            self._messages.append({"role": turn.role, "content": self._content})
            self._role, self._content = None, ""

    def _prompt(self) -> str:
        """What the model reads before the next generated token."""
        if not self.is_chat:
            return self._text
        if self._role != "assistant":
            raise LangError("gen and select run inside an assistant turn: assistant(gen(...))")
        return self._chat_template().render(self._messages, generation=True) + self._content

    def _generate(
        self, name: str | None, params: dict[str, Any], choices: tuple[str, ...] | None = None
    ) -> None:
        out = self.backend.generate(self._prompt(), params)
        if choices is not None and out not in choices:
            raise LangError(f"select got {out!r}, none of {list(choices)}")
        self._keep(name, out)

    def _select(self, item: Select) -> None:
        if item.method == "greedy":
            regex = choices_regex(item.choices)
            params = {"max_new_tokens": 256, "temperature": 0, "regex": regex}
            self._generate(item.name, params, item.choices)
            return
        scores = self.backend.score(self._prompt(), list(item.choices))
        best = max(range(len(scores)), key=scores.__getitem__)  # the first of equals
        if item.name is not None:
            self.meta[item.name] = {"scores": dict(zip(item.choices, scores, strict=True))}
        self._keep(item.name, item.choices[best])

    def _keep(self, name: str | None, text: str) -> None:
        if name is not None:
            self.variables[name] = text
        self._append_text(text)

    def _chat_template(self) -> ChatTemplate:
        return self.backend.chat_template()


class ForkGroup(list[ProgramState]):
    """Branches of one state; `forks += item` runs `item` on every branch at once."""

    def __iadd__(self, item: Item) -> ForkGroup:  # type: ignore[override,misc]
        with ThreadPoolExecutor(max_workers=max(1, len(self))) as pool:
            for done in [pool.submit(state._append, item) for state in self]:
                done.result()
        return self
