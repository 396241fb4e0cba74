"""Transition tables as data for the project's sans-IO state machines (h11 ``_state.py`` style).

A machine's rules are a list of :class:`Transition` rows: in this state (or these, or any), on this event
type, when this guard holds, run this effect, which may emit these action types and move to these
states. :meth:`TransitionTable.fire` looks the (state, event type) pair up, picks the first row
whose guard holds and runs its effect; a pair the table does not name is refused with
:class:`IllegalTransition` before anything changes. After the effect the table checks that the
row kept its word (actions of the declared types only, next state among the declared ones), so
the table can never silently drift from what the code does. :meth:`TransitionTable.render`
prints the rows as the text table ``docs/protocol.md`` shows (a test keeps the two equal).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Sequence

ANY = None   # a row's state: the row applies in every state (after the rows declared before it)
StateSet = enum.Enum | tuple[enum.Enum, ...] | None   # one state, several (one row, one rule), or ANY


class IllegalTransition(TypeError):
    """An event the machine's table has no row for in its current state; the machine is unchanged."""


def _always(machine: Any, event: Any) -> bool:
    return True


@dataclass(frozen=True)
class Transition:
    state: StateSet                # ANY: every state; a tuple: each of those states
    event: type
    when: str                      # the guard as the table prints it ("" when unguarded)
    effect: Callable[[Any, Any], list]
    emits: tuple[type, ...] = ()   # action types the effect may return, in the order it returns them
    goes_to: tuple[enum.Enum, ...] = ()   # states the effect may move to (besides staying)
    note: str = ""
    guard: Callable[[Any, Any], bool] = _always

    def applies_in(self, state: enum.Enum) -> bool:
        return self.state is ANY or self.state is state or (isinstance(self.state, tuple) and state in self.state)

    def state_text(self) -> str:
        if self.state is ANY:
            return "any"
        if not isinstance(self.state, tuple):
            return self.state.name
        others = [s.name for s in type(self.state[0]) if s not in self.state]
        # the shorter of the two lists: "all but FINISHED|ABORTED" reads better than five live states
        return f"all but {'|'.join(others)}" if len(others) < len(self.state) else "|".join(s.name for s in self.state)


class TransitionTable:
    def __init__(self, states: type[enum.Enum], rows: Sequence[Transition]) -> None:
        self.states = states
        self.rows = tuple(rows)
        self.events = tuple(dict.fromkeys(row.event for row in self.rows))
        # (state, event type) -> the rows to try in order: any-state rows sit where they were declared
        self._index: dict[tuple[enum.Enum, type], tuple[Transition, ...]] = {}
        for state in states:
            for event in self.events:
                candidates = tuple(r for r in self.rows if r.event is event and r.applies_in(state))
                if candidates:
                    if candidates[-1].guard is not _always:
                        raise ValueError(f"{states.__name__}.{state.name} on {event.__name__}: the last row "
                                         "must be unguarded, so that some row always applies")
                    self._index[state, event] = candidates

    def entries(self) -> list[tuple[enum.Enum, Transition]]:
        """Every (state, row) the table can fire: an any-state row once per state it applies in."""
        return [(state, row) for (state, _), rows in self._index.items() for row in rows]

    def select(self, machine: Any, event: Any) -> Transition:
        """The row that `event` fires in `machine`'s current state (pure: changes nothing)."""
        rows = self._index.get((machine.state, type(event)))
        if rows is None:
            raise IllegalTransition(f"{type(machine).__name__} in state {machine.state.name} has no transition "
                                    f"for {type(event).__name__} (event {event!r})")
        return next(row for row in rows if row.guard(machine, event))

    def fire(self, machine: Any, event: Any) -> list:
        row = self.select(machine, event)
        before = machine.state
        actions = row.effect(machine, event)
        stray = [a for a in actions if not isinstance(a, row.emits)]
        if stray or (machine.state is not before and machine.state not in row.goes_to):
            raise AssertionError(f"transition {self.describe(row)} broke its row: emitted {stray}, "
                                 f"moved {before.name} -> {machine.state.name}")
        return actions

    def describe(self, row: Transition) -> str:
        return f"{row.state_text()} {row.event.__name__}" + (f" [{row.when}]" if row.when else "")

    def _follows_another(self, row: Transition) -> bool:
        earlier = self.rows[:self.rows.index(row)]
        return any(e.event is row.event and any(e.applies_in(s) and row.applies_in(s) for s in self.states)
                   for e in earlier)

    def render(self) -> str:
        """The table as fixed-width text, one line per row (what docs/protocol.md shows)."""
        header = ("state", "event", "when", "actions", "next", "note")
        lines = [header] + [(
            r.state_text(),
            r.event.__name__,
            r.when or ("otherwise" if self._follows_another(r) else "-"),
            ", ".join(t.__name__ for t in r.emits) or "-",
            " / ".join(s.name for s in r.goes_to) or "-",
            r.note,
        ) for r in self.rows]
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)
