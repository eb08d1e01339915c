"""The background compile queue (marinctl/train/precompile.py): order, results, errors, cancellation."""

import threading

import jax
import pytest

from marinctl.train.precompile import Precompiler


def mesh():
    return jax.make_mesh((1,), ("data",))


def test_jobs_run_in_order_under_the_mesh_and_get_waits_for_each():
    order, gate = [], threading.Event()

    def job(name):
        def build():
            if name == "a":
                gate.wait(10)  # `get("b")` must wait behind the running `a`
            order.append(name)
            return name, jax.sharding.get_abstract_mesh().axis_names

        return build

    compiler = Precompiler(mesh(), [("a", job("a")), ("b", job("b"))])
    gate.set()
    assert compiler.get("b", lambda: pytest.fail("b was queued")) == ("b", ("data",))
    assert compiler.get("a", lambda: pytest.fail("a was queued")) == ("a", ("data",))
    assert order == ["a", "b"]
    assert compiler.get("c", lambda: "built here") == "built here"  # never queued: the caller builds it
    compiler.close()


def test_a_failed_job_raises_where_its_result_is_taken():
    def broken():
        raise ValueError("does not compile")

    compiler = Precompiler(mesh(), [("x", broken)])
    with pytest.raises(ValueError, match="does not compile"):
        compiler.get("x", lambda: None)
    compiler.close()


def test_close_waits_for_the_running_job_and_cancels_the_rest():
    started, release, ran = threading.Event(), threading.Event(), []

    def slow():
        started.set()
        release.wait(10)
        ran.append("slow")

    compiler = Precompiler(mesh(), [("slow", slow), ("later", lambda: ran.append("later"))])
    assert started.wait(10)
    closer = threading.Thread(target=compiler.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # a compile in flight is waited for, not abandoned
    release.set()
    closer.join(10)
    assert not closer.is_alive() and ran == ["slow"]  # the queued job never ran
    assert compiler.get("later", lambda: "built here") == "built here"
