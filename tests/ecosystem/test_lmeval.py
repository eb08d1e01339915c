"""marinctl/lmeval.py and `marinctl eval --tasks`: lm-evaluation-harness on the JAX model, dropless.

The oracle throughout is a direct computation: the model assembled with the `dense` transport from the
fixture's own arrays (not through any loader), one unpadded row per request, log-softmax in numpy.
"""

import dataclasses
import json
from types import SimpleNamespace

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest

from marinctl.cli import run as cli
from marinctl.data.tokenizer import ByteTokenizer
from marinctl.errors import UserError
from marinctl.lmeval import bucket_lengths, marin_lm_class, run_tasks, task_manager

TASKS = __import__("pathlib").Path(__file__).resolve().parent / "tasks"

BYTE = ByteTokenizer()


def dense_model(recipe, params):
    from marinctl.model.transformer import build_model

    dense = recipe.replace(moe=dataclasses.replace(recipe.moe, transport="dense"))
    return build_model(dense, {k: jnp.asarray(v) for k, v in params.items()})


# The model's own call, compiled: run eagerly it took 6-10 s per row here (each op dispatched alone), and the
# oracle is one row per request. One compile per row length (~1.4 s); the arithmetic is the model's.
forward = eqx.filter_jit(lambda model, tokens, segs, bias: model(tokens, segs, bias))


def direct_logprobs(model, bias, ids):
    """log p(ids[t+1] | ids[:t+1]) for one unpadded row, float64 log-softmax on the host."""
    tokens = jnp.asarray([ids], jnp.int32)
    logits, _ = forward(model, tokens, jnp.ones_like(tokens), jnp.asarray(bias))
    logits = np.asarray(logits[0], np.float64)
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    return logp[np.arange(len(ids) - 1), ids[1:]], logits.argmax(-1)


def encode(text):
    return [int(t) for t in BYTE.encode_batch([text])[0]]


def direct_loglikelihood(model, bias, context, continuation):
    ctx = [BYTE.bos_id, *encode(context)]
    cont = encode(continuation)
    logp, greedy = direct_logprobs(model, bias, ctx + cont)
    n = len(cont)
    return float(logp[-n:].sum()), bool(np.all(greedy[len(ctx) - 1 : -1] == np.asarray(cont)))


def requests(*args):
    return [SimpleNamespace(args=a) for a in args]


@pytest.fixture(scope="module")
def lm(eco_run):
    _, run_dir, _, _ = eco_run
    return marin_lm_class()(pretrained=str(run_dir), batch_size=4)


def test_loglikelihoods_lm_eval_receives_equal_a_direct_computation(eco_run, at_repo):
    recipe, run_dir, params, bias = eco_run
    # Five documents: the fourth ends its context in spaces, which must stay context (byte tokens).
    results = run_tasks(run_dir, ["marin_local_mc"], include_path=TASKS, limit=5, log_samples=True, batch_size=4)
    samples = results["samples"]["marin_local_mc"]
    assert len(samples) == 5 and any(s["arguments"][0][0].endswith("   ") for s in samples)
    model = dense_model(recipe, params)
    correct = []
    for sample in samples:
        got = [resp[0] for resp in sample["resps"]]  # what lm-eval received from MarinLM, per choice
        want = [direct_loglikelihood(model, bias, *args) for args in sample["arguments"]]
        np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=1e-5, atol=1e-4)
        assert [g[1] for g in got] == [w[1] for w in want]
        correct.append(int(np.argmax([w[0] for w in want])) == sample["target"])
    assert results["results"]["marin_local_mc"]["acc,none"] == pytest.approx(np.mean(correct))
    info = results["marinctl"]
    assert info["dropless"] and info["transport"] == "ragged"  # the recipe trains with `pooled`; top-2 of 8
    assert info["step"] == 5 and info["kind"] == "run"
    assert info["timing"]["loglikelihood"]["requests"] == 15


def test_requests_of_any_length_compile_once_per_bucket(lm, eco_run):
    recipe, _, params, bias = eco_run
    assert bucket_lengths(128) == [32, 64, 128] and bucket_lengths(100) == [32, 64, 100]
    model = dense_model(recipe, params)
    before = lm.scorer.compiles
    texts = [("x" * n, " y" * (1 + n % 3)) for n in (1, 5, 17, 30, 33, 40, 63, 64, 90, 120, 126, 200)]
    got = lm.loglikelihood(requests(*texts))
    assert lm.scorer.compiles - before <= 3  # 12 lengths, three buckets (some may be compiled already)
    again = lm.loglikelihood(requests(*texts[::-1]))
    assert again == got[::-1]  # batch composition and order do not change a score
    for k in (0, 4, 10):  # one request per bucket against the unpadded computation (each is a compile)
        ctx, cont = texts[k]
        assert got[k][0] == pytest.approx(direct_loglikelihood(model, bias, ctx, cont)[0], rel=1e-5, abs=1e-4)
    assert lm.scorer.compiles - before <= 3


def test_rolling_loglikelihood_of_a_text_equals_its_direct_log_probability(lm, eco_run):
    recipe, _, params, bias = eco_run
    model = dense_model(recipe, params)
    texts = ["def f(x):\n    return x * 2\n", "Ünïcödé → bytes"]
    got = lm.loglikelihood_rolling(requests(*[(t,) for t in texts]))
    for text, ll in zip(texts, got, strict=True):
        logp, _ = direct_logprobs(model, bias, [BYTE.bos_id, *encode(text)])
        assert ll == pytest.approx(float(logp.sum()), rel=1e-5)
    # Longer than the context: disjoint windows of at most max_length predictions, every token once.
    long_text = "abcdefghij" * 30
    (ll,) = lm.loglikelihood_rolling(requests((long_text,)))
    assert np.isfinite(ll) and ll < got[0]


def test_generate_until_is_greedy_decoding_and_stops_at_until(lm, eco_run):
    recipe, _, params, bias = eco_run
    model = dense_model(recipe, params)

    def greedy(context, n):
        ids = [BYTE.bos_id, *encode(context)]
        out = []
        for _ in range(n):
            _, argmax = direct_logprobs(model, bias, ids)
            if int(argmax[-1]) == BYTE.eos_id:
                break
            ids.append(int(argmax[-1]))
            out.append(ids[-1])
        return BYTE.decode(out)

    contexts = ["import ", "x = [1, 2,"]
    got = lm.generate_until(requests(*[(c, {"until": [], "max_gen_toks": 4}) for c in contexts]))
    assert got == [greedy(c, 4) for c in contexts]
    # A stop string: an ASCII character the free run produced (a partial UTF-8 byte sequence decodes to
    # U+FFFD until it completes, so it cannot serve as one).
    ascii_out = [(i, c) for i, c in enumerate(got[0]) if c.isascii() and c not in got[0][:i]]
    if ascii_out:
        stop = ascii_out[-1][1]
        (cut,) = lm.generate_until(requests(("import ", {"until": [stop], "max_gen_toks": 4})))
        assert cut == got[0][: got[0].index(stop)]


def test_eval_tasks_cli_prints_a_table_and_lm_evals_json(eco_run, at_repo, capsys):
    _, run_dir, _, _ = eco_run
    args = ["eval", str(run_dir), "--tasks", "marin_local", "--include-path", str(TASKS), "--limit", "3"]
    assert cli([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["results"]) >= {"marin_local_mc", "marin_local_ppl", "marin_local_gen"}
    assert out["n-samples"]["marin_local_mc"]["effective"] == 3
    assert 0.0 <= out["results"]["marin_local_mc"]["acc,none"] <= 1.0
    assert out["results"]["marin_local_ppl"]["bits_per_byte,none"] > 0
    timing = out["marinctl"]["timing"]
    assert {"loglikelihood", "loglikelihood_rolling", "generate_until"} <= set(timing)
    assert out["marinctl"]["compiles"] <= len(out["marinctl"]["buckets"])
    assert cli([*args[:6], "--limit", "2"]) == 0
    table = capsys.readouterr().err
    assert "marin_local_mc" in table and "acc" in table and "ms/req" in table


def test_an_export_evaluates_like_its_run(eco_run, at_repo, tmp_path):
    _, run_dir, _, _ = eco_run
    assert cli(["export", str(run_dir), "--out", str(tmp_path / "hf"), "--format", "hf", "-q"]) == 0
    from_run = run_tasks(run_dir, ["marin_local_mc"], include_path=TASKS, limit=4)
    from_hf = run_tasks(tmp_path / "hf", ["marin_local_mc"], include_path=TASKS, limit=4)
    assert from_hf["marinctl"]["kind"] == "hf"
    assert from_hf["results"]["marin_local_mc"] == from_run["results"]["marin_local_mc"]


def test_unknown_task_is_named(tmp_path):
    with pytest.raises(UserError, match=r"knows no task 'marin_local_mcq'.*did you mean 'marin_local_mc'"):
        task_manager(["marin_local_mcq"], TASKS, include_defaults=False)


@pytest.mark.parametrize(
    "make_args, message",
    [
        (lambda run, tmp: [str(tmp / "nothing"), "--tasks", "marin_local"], "no such run or export directory"),
        (lambda run, tmp: [str(tmp), "--tasks", "marin_local"], "neither a run directory"),
        (lambda run, tmp: [str(run), "--tasks", ","], "name at least one task"),
        (lambda run, tmp: [str(run), "--tasks", "marin_local", "--transport", "pooled"], "always run dropless"),
        (lambda run, tmp: [str(run), "--tasks", "x", "--include-path", str(tmp / "no")], "no such directory"),
        (lambda run, tmp: [str(run), "--limit", "3"], "--limit applies only with --tasks"),
    ],
)
def test_eval_tasks_mistakes_exit_2_with_one_line(eco_run, tmp_path, capsys, make_args, message):
    _, run_dir, _, _ = eco_run
    assert cli(["eval", *make_args(run_dir, tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_run_without_a_checkpoint_is_named(eco_run, tmp_path, at_repo, capsys):
    _, run_dir, _, _ = eco_run
    empty = tmp_path / "run"
    empty.mkdir()
    (empty / "recipe.toml").write_text((run_dir / "recipe.toml").read_text())
    assert cli(["eval", str(empty), "--tasks", "marin_local_mc", "--include-path", str(TASKS)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no checkpoint" in err and len(err.splitlines()) == 1, err


def test_inference_is_dropless_whatever_the_training_transport(eco_run, monkeypatch):
    """The pooled transport drops on this batch and moves the logits; inference never does."""
    import marinctl.train.evaluate
    from marinctl.export import inference_model
    from marinctl.model.transformer import build_model

    recipe, _, params, bias = eco_run
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 256, (2, 128)), jnp.int32)
    segs = jnp.ones_like(tokens)
    jparams = {k: jnp.asarray(v) for k, v in params.items()}
    want = np.asarray(forward(dense_model(recipe, params), tokens, segs, jnp.asarray(bias))[0])
    pooled_logits, stats = forward(build_model(recipe, jparams), tokens, segs, jnp.asarray(bias))
    assert float(jnp.sum(stats["sender_drops"]) + jnp.sum(stats["receiver_drops"])) > 0
    assert np.abs(np.asarray(pooled_logits) - want).max() > 1e-3  # drops change the logits
    model, used = inference_model(recipe, jparams, tokens.size)  # top-2 of 8: dense would do 4x the work
    assert used.moe.transport == "ragged" and used.moe.ragged_buffer_factor is None
    np.testing.assert_allclose(np.asarray(forward(model, tokens, segs, jnp.asarray(bias))[0]), want, atol=1e-4)
    monkeypatch.setattr(marinctl.train.evaluate, "DENSE_WORK_RATIO", 4)  # dense allowed 4x the routed work
    model, used = inference_model(recipe, jparams, tokens.size)
    assert used.moe.transport == "dense"
    np.testing.assert_array_equal(np.asarray(forward(model, tokens, segs, jnp.asarray(bias))[0]), want)
    monkeypatch.setattr(marinctl.train.evaluate, "DENSE_EVAL_BYTES", 1)  # as for hero-sized experts
    model, used = inference_model(recipe, jparams, tokens.size)
    assert used.moe.transport == "ragged" and used.moe.ragged_buffer_factor is None
    np.testing.assert_allclose(np.asarray(forward(model, tokens, segs, jnp.asarray(bias))[0]), want, atol=1e-4)
