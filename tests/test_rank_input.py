"""How the ranks' questions are put to the user: pure logic, with a stand-in socket and
user (test_magics.py drives the real thing through a kernel)."""

from __future__ import annotations

import pytest
from IPython.core.error import StdinNotImplementedError
from mpilab import rank_input
from mpilab.rank_input import CellQuestions, Question
from mpilab.wire import input_answer, input_question, input_route, read_input


class Desk:
    """Stands in for InputDesk: questions arrive as asked, answers are kept."""

    def __init__(self, questions: dict[tuple[int, int], tuple[str, bool]]):
        self.questions = questions
        self.answers: list[tuple[int, str | None, str]] = []

    def question(self, rank, route, qid):
        assert route == f"r{rank}".encode()  # the route the marker names
        prompt, password = self.questions[(rank, qid)]
        return Question(rank, qid, prompt, password, route)

    def answer(self, question, text, refused=""):
        self.answers.append((question.rank, text, refused))


def _user(monkeypatch, replies):
    asked = []

    def ask(prompt, password):
        asked.append((prompt, password))
        reply = replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    monkeypatch.setattr(rank_input, "_ask_user", ask)
    return asked


def test_ranks_at_the_same_prompt_are_asked_once_and_each_gets_the_answer(monkeypatch):
    desk = Desk({(0, 1): ("(Pdb) ", False), (1, 1): ("(Pdb) ", False),
                 (2, 1): ("name? ", False)})
    asked = _user(monkeypatch, ["n", "ada"])
    questions = CellQuestions(desk, 4, write=lambda *a: None)
    questions.add(0, {"id": 1, "route": "r0"})
    assert not questions.due([0, 1, 2, 3])  # the others may be about to ask
    questions.add(1, {"id": 1, "route": "r1"})
    questions.add(2, {"id": 1, "route": "r2"})
    assert questions.due([0, 1, 2])  # every rank still running has asked (3 finished)
    questions.ask()
    assert asked == [("[ranks 0-1] (Pdb) ", False), ("[rank 2] name? ", False)]
    assert desk.answers == [(0, "n", ""), (1, "n", ""), (2, "ada", "")]
    assert questions.answered_at > 0 and not questions.waiting
    assert not questions.due([0, 1, 2])


def test_questions_wait_for_more_until_none_has_come_for_a_moment(monkeypatch):
    desk = Desk({(3, 7): ("go? ", False), (4, 7): ("go? ", False)})
    questions = CellQuestions(desk, 8, write=lambda *a: None)
    clock = [100.0]
    monkeypatch.setattr(rank_input.time, "monotonic", lambda: clock[0])
    questions.add(3, {"id": 7, "route": "r3"})
    assert not questions.due(list(range(8)))
    clock[0] += rank_input.GATHER_S * 0.9
    questions.add(4, {"id": 7, "route": "r4"})  # another came: the wait starts again
    clock[0] += rank_input.GATHER_S * 0.9
    assert not questions.due(list(range(8)))
    clock[0] += rank_input.GATHER_S * 0.2
    assert questions.due(list(range(8)))


def test_one_rank_cell_shows_the_prompt_as_it_is_and_passwords_stay_passwords(monkeypatch):
    desk = Desk({(1, 1): ("Password: ", True)})
    asked = _user(monkeypatch, ["pw"])
    questions = CellQuestions(desk, 1, write=lambda *a: None)
    questions.add(1, {"id": 1, "route": "r1"})
    questions.ask()
    assert asked == [("Password: ", True)]


def test_a_frontend_without_input_is_one_line_and_the_ranks_get_end_of_file(monkeypatch):
    desk = Desk({(0, 1): ("name? ", False), (1, 1): ("name? ", False)})
    _user(monkeypatch, [StdinNotImplementedError("no stdin")])
    written = []
    questions = CellQuestions(desk, 2, write=lambda stream, text: written.append((stream, text)))
    questions.add(0, {"id": 1, "route": "r0"})
    questions.add(1, {"id": 1, "route": "r1"})
    questions.ask()
    assert written == [("stderr", "mpilab: ranks 0-1 asked for input ('name?'), but this "
                                  "notebook's frontend takes no input: their input() raised "
                                  "EOFError\n")]
    assert [(r, text) for r, text, _ in desk.answers] == [(0, None), (1, None)]
    assert all("takes no input" in why for _, _, why in desk.answers)


def test_the_stop_button_while_asking_reaches_the_cell_and_nothing_is_answered(monkeypatch):
    desk = Desk({(0, 1): ("(Pdb) ", False)})
    _user(monkeypatch, [KeyboardInterrupt()])
    questions = CellQuestions(desk, 2, write=lambda *a: None)
    questions.add(0, {"id": 1, "route": "r0"})
    with pytest.raises(KeyboardInterrupt):
        questions.ask()
    assert desk.answers == []  # the interrupt stops the rank's wait itself


def test_a_cell_that_cannot_ask_answers_at_once_with_why(monkeypatch):
    desk = Desk({(0, 1): ("x? ", False)})
    asked = _user(monkeypatch, [])
    questions = CellQuestions(desk, 2, write=lambda *a: None, refuse="a --noblock cell")
    questions.add(0, {"id": 1, "route": "r0"})
    assert not questions.waiting and not questions.due([0, 1]) and asked == []
    assert desk.answers == [(0, None, "a --noblock cell")]
    # a question left when the cell ends is not left waiting
    late = CellQuestions(Desk({(1, 2): ("y? ", False)}), 2, write=lambda *a: None)
    late.add(1, {"id": 2, "route": "r1"})
    late.close("the cell ended")
    assert late.desk.answers == [(1, None, "the cell ended")]


def test_a_marker_without_the_route_of_its_socket_is_not_answered():
    desk = Desk({(0, 1): ("x? ", False)})
    questions = CellQuestions(desk, 2, write=lambda *a: None)
    questions.add(0, {"id": 1})
    assert not questions.waiting and desk.answers == []


def test_a_rank_s_route_cannot_be_guessed():
    first, second = input_route(3), input_route(3)
    assert first.startswith("rank-3-") and first != second and len(first) > 30


def test_questions_and_answers_cross_as_defined_once():
    assert read_input(input_question(3, "(Pdb) ", False)) == {
        "id": 3, "prompt": "(Pdb) ", "password": False}
    assert read_input(input_answer(3, None, "no input")) == {
        "id": 3, "text": None, "refused": "no input"}
    with pytest.raises(ValueError):
        read_input(b'["not", "a", "question"]')


def test_debug_after_the_failed_ranks_were_restarted_is_one_line():
    from mpilab.cluster import ClusterError
    from mpilab.runner import RanksError
    from mpilab.session import Session

    session = Session()  # no ranks running: RankCluster's generation 0
    assert not session.post_mortem(ZeroDivisionError())  # the notebook's own: IPython's %debug
    assert not session.post_mortem(RanksError("interrupted", failed=[]))
    with pytest.raises(ClusterError, match="^the ranks that failed have been stopped or "
                                           "restarted since: their error is gone; run the "
                                           "cell again, then `%debug`$"):
        session.post_mortem(RanksError("failed", failed=[1], generation=3))
