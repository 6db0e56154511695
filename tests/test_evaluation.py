"""``hf-ring eval needle`` / ``eval ppl`` on tiny random models: one process, CP = 2 and DP = 2 equal
to one process, scores equal to a float64 full-logits oracle, the files hold the grid asked for, and
bad input is refused clearly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, BloomConfig

from hf_ring.cli import main
from hf_ring.evaluation import EvalError, PasskeySource, Runtime, TextSource, evaluate_needle, score_answer
from hf_ring.evaluation.needle import DEFAULT_NEEDLE, DEFAULT_QUESTION, FILLER
from hf_ring.evaluation.runtime import parse_depths, parse_lengths
from testkit.models import tiny_model
from testkit.spawn import run_ranks

LENGTHS, DEPTHS = "37,96", "0,50,100"  # 37: shard_batch pads it at CP = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "llama"
    tiny_model("llama", "sdpa").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def one_process(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("needle1")
    assert main(["eval", "needle", str(model_dir), "--lengths", LENGTHS, "--depths", DEPTHS, "--out", str(out)]) == 0
    return json.loads((out / "needle.json").read_text()) | {"out": str(out)}


def test_lists_expand_and_refuse() -> None:
    assert parse_lengths("1K,2K,...,16K") == [1024 * 2**i for i in range(5)]
    assert parse_lengths("4K,1K,2K") == [1024, 2048, 4096]
    assert parse_depths("0,10,...,100") == list(range(0, 101, 10))
    assert parse_depths("0,12.5,...,100")[1:3] == [12.5, 25]
    with pytest.raises(EvalError, match="outside 0-100"):
        parse_depths("0,50,120")
    with pytest.raises(EvalError, match="do not end at"):
        parse_lengths("1K,2K,...,3K")


def test_score_answer_matches_float64_oracle() -> None:
    model = tiny_model("llama", "ring").eval()
    ref = tiny_model("llama", "sdpa", torch.float64).eval()
    case = PasskeySource().make(61, 30, seed=0, sample=0)
    logprob, hit = score_answer(model, case.ids, case.answer_at)
    with torch.no_grad():
        logits = ref(input_ids=case.ids[None]).logits[0]
    want = logits[case.answer_at - 1 : -1].log_softmax(-1).gather(1, case.ids[case.answer_at :, None]).squeeze(1)
    assert torch.allclose(logprob, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(hit, logits[case.answer_at - 1 : -1].argmax(-1) == case.ids[case.answer_at :])


def test_needle_one_process_writes_the_grid(one_process: dict) -> None:
    cells = one_process["cells"]
    assert one_process["lengths"] == [37, 96] and one_process["depths"] == [0, 50, 100]
    assert [(c["length"], c["depth"]) for c in cells] == [(n, d) for n in (37, 96) for d in (0, 50, 100)]
    for c in cells:
        assert c["accuracy"] in (0.0, 1.0) and math.isfinite(c["answer_logprob"]) and c["answer_tokens"] == 5
    assert {c["samples"][0]["needle_at"] for c in cells if c["depth"] == 0} == {0}
    assert [c["samples"][0]["needle_at"] for c in cells if c["depth"] == 100] == [37 - 12, 96 - 12]
    assert one_process["settings"]["mode"] == "passkey" and one_process["settings"]["cp_size"] == 1
    png = Path(one_process["out"]) / "needle.png"
    pytest.importorskip("matplotlib")
    from PIL import Image

    drawn = json.loads(Image.open(png).text["Description"])
    assert drawn["lengths"] == [37, 96] and drawn["depths"] == [0, 50, 100]
    assert drawn["values"] == [[c["accuracy"] for c in cells if c["depth"] == d] for d in (0, 50, 100)]


def needle_cli(model_dir: str, out: str, cp_size: int) -> None:
    argv = ["eval", "needle", model_dir, "--lengths", LENGTHS, "--depths", DEPTHS, "--out", out]
    main([*argv, "--cp-size", str(cp_size)])


@pytest.mark.parametrize("cp_size", [2, 1], ids=["cp2", "dp2"])
def test_needle_two_ranks_equal_one_process(cp_size: int, model_dir: Path, one_process: dict, tmp_path: Path) -> None:
    run_ranks(2, needle_cli, str(model_dir), str(tmp_path), cp_size)
    got = json.loads((tmp_path / "needle.json").read_text())
    assert got["settings"]["cp_size"] == cp_size and got["settings"]["dp_size"] == 2 // cp_size
    cells = [(c["length"], c["depth"]) for c in got["cells"]]
    assert cells == [(c["length"], c["depth"]) for c in one_process["cells"]]
    diff = max(abs(a["answer_logprob"] - b["answer_logprob"]) for a, b in zip(got["cells"], one_process["cells"]))
    print(f"max |answer_logprob(CP={cp_size}, DP={2 // cp_size}) - answer_logprob(1 process)| = {diff:.3g}")
    assert diff <= 1e-4
    assert [c["accuracy"] for c in got["cells"]] == [c["accuracy"] for c in one_process["cells"]]
    assert (tmp_path / "needle.png").exists() or pytest.importorskip("matplotlib") is None


def tiny_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<s>"], initial_alphabet=alphabet)
    tok.train_from_iterator([FILLER, DEFAULT_NEEDLE, DEFAULT_QUESTION], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<unk>").save_pretrained(path)


def test_needle_text_mode_places_the_needle(tmp_path: Path) -> None:
    tiny_model("llama", "sdpa", vocab_size=320).save_pretrained(tmp_path / "m")
    tiny_tokenizer(tmp_path / "m")
    (tmp_path / "hay.txt").write_text("Snow falls on the hills. Birds sing in the morning. " * 3)
    argv = ["eval", "needle", str(tmp_path / "m"), "--lengths", "200,300", "--depths", "0,40,100"]
    assert main([*argv, "--haystack", str(tmp_path / "hay.txt"), "--out", str(tmp_path / "o")]) == 0
    result = json.loads((tmp_path / "o" / "needle.json").read_text())
    assert result["settings"]["mode"] == "text" and len(result["cells"]) == 6
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "m")
    source = TextSource(tok, str(tmp_path / "hay.txt"))
    for n in (200, 300):
        for d in (0, 40, 100):
            case = source.make(n, d, seed=0, sample=0)
            text = tok.decode(case.ids)
            assert len(case.ids) == n and text.endswith(f"The pass key is {case.key}")
            assert tok.decode(case.ids[case.needle_at :]).startswith(DEFAULT_NEEDLE.format(key=case.key))
            before = tok.decode(case.ids[: case.needle_at]).rstrip()
            assert before == "" or before.endswith(".")  # after a sentence end
            room = n - len(source.prefix) - sum(len(p) for p in source._parts(case.key))
            target = len(source.prefix) + round(d / 100 * room)
            assert target - 30 <= case.needle_at <= target  # moved back to a sentence end, if at all


def bloom_dir(path: Path) -> Path:
    cfg = BloomConfig(n_layer=1, hidden_size=32, n_head=4, vocab_size=97, bos_token_id=0, eos_token_id=0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lengths", "8,64"], "length 8 is shorter than the passkey's needle, question and answer"),
        (["--lengths", "64", "--depths", "0,50,120"], "outside 0-100"),
        (["--lengths", "64", "--needle", "key {key}"], "need a tokenizer"),
        (["--lengths", "64", "--mode", "text"], "needs a tokenizer"),
        (["bloom", "--lengths", "64"], "computes attention itself"),
    ],
    ids=["short", "depth", "needle-without-tokenizer", "text-without-tokenizer", "no-ring"],
)
def test_needle_bad_input_is_refused(args: list[str], message: str, model_dir: Path, tmp_path: Path) -> None:
    model = str(bloom_dir(tmp_path / "bloom")) if args[0] == "bloom" else str(model_dir)
    argv = ["eval", "needle", model, *[a for a in args if a != "bloom"], "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert str(e.value.code).startswith("hf-ring eval needle: ") and message in str(e.value.code)
    assert not (tmp_path / "o" / "needle.json").exists()


def test_model_loaded_without_ring_is_refused() -> None:
    with pytest.raises(EvalError, match="attn_implementation='sdpa', not 'ring'"):
        evaluate_needle(tiny_model("llama", "sdpa"), PasskeySource(), [64], [50], Runtime())


# --- eval ppl --------------------------------------------------------------------------------------

DOC_LENGTHS, SEQ_LEN, BUCKETS = (130, 50, 100, 161), 100, 4  # the 50-token document is too short


@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    g = torch.Generator().manual_seed(5)
    lines = [json.dumps({"input_ids": torch.randint(0, 97, (n,), generator=g).tolist()}) for n in DOC_LENGTHS]
    path.write_text("\n".join(lines) + "\n")
    return path


def ppl_argv(model_dir: Path, docs: Path, out: Path) -> list[str]:
    return ["eval", "ppl", str(model_dir), "--data", str(docs), "--seq-len", str(SEQ_LEN), "--buckets", str(BUCKETS),
            "--out", str(out)]  # fmt: skip


@pytest.fixture(scope="module")
def ppl_one_process(model_dir: Path, docs: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("ppl1")
    assert main([*ppl_argv(model_dir, docs, out), "--chunk-size", "7"]) == 0  # 7: chunks that do not divide
    return json.loads((out / "ppl.json").read_text()) | {"out": str(out)}


def test_ppl_matches_float64_oracle(ppl_one_process: dict, docs: Path) -> None:
    ref = tiny_model("llama", "sdpa", torch.float64).eval()
    sums, counts = torch.zeros(BUCKETS, dtype=torch.float64), torch.zeros(BUCKETS)
    for line in docs.read_text().splitlines():
        ids = torch.tensor(json.loads(line)["input_ids"])
        if len(ids) < SEQ_LEN:
            continue
        ids = ids[:SEQ_LEN]
        with torch.no_grad():
            nll = torch.nn.functional.cross_entropy(ref(input_ids=ids[None]).logits[0, :-1], ids[1:], reduction="none")
        bucket = torch.arange(1, SEQ_LEN) // (SEQ_LEN // BUCKETS)
        sums.index_add_(0, bucket, nll)
        counts.index_add_(0, bucket, torch.ones(SEQ_LEN - 1))
    got = ppl_one_process
    assert got["documents"] == 3 and got["skipped_short"] == 1 and got["bucket_size"] == SEQ_LEN // BUCKETS
    assert [b["tokens"] for b in got["buckets"]] == counts.long().tolist()
    want = (sums / counts).tolist()
    assert all(abs(b["loss"] - w) <= 1e-5 * w for b, w in zip(got["buckets"], want))
    assert abs(got["loss"] - float(sums.sum() / counts.sum())) <= 1e-5 * got["loss"]
    assert (Path(got["out"]) / "ppl.png").exists() or pytest.importorskip("matplotlib") is None


def ppl_cli(argv: list[str], cp_size: int) -> None:
    main([*argv, "--cp-size", str(cp_size)])


@pytest.mark.parametrize("cp_size", [2, 1], ids=["cp2", "dp2"])
def test_ppl_two_ranks_equal_one_process(
    cp_size: int, model_dir: Path, docs: Path, ppl_one_process: dict, tmp_path: Path
) -> None:
    run_ranks(2, ppl_cli, ppl_argv(model_dir, docs, tmp_path), cp_size)
    got = json.loads((tmp_path / "ppl.json").read_text())
    assert got["settings"]["cp_size"] == cp_size and got["documents"] == 3
    assert [b["tokens"] for b in got["buckets"]] == [b["tokens"] for b in ppl_one_process["buckets"]]
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(got["buckets"], ppl_one_process["buckets"]))
    print(f"max |bucket loss(CP={cp_size}, DP={2 // cp_size}) - bucket loss(1 process)| = {diff:.3g}")
    assert diff <= 1e-5


def test_ppl_without_a_long_document_is_refused(model_dir: Path, docs: Path, tmp_path: Path) -> None:
    argv = ppl_argv(model_dir, docs, tmp_path)
    with pytest.raises(SystemExit, match="no document has --seq-len 1000 tokens .the longest has 161."):
        main([*argv[:6], "1000", *argv[7:]])


# --- adapters, plots, no matplotlib ---------------------------------------------------------------


def test_adapter_is_applied(model_dir: Path, tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="ring")
    peft = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft.save_pretrained(tmp_path / "adapter")
    argv = ["eval", "needle", str(model_dir), "--adapter", str(tmp_path / "adapter"), "--lengths", "61"]
    assert main([*argv, "--depths", "30", "--out", str(tmp_path / "o")]) == 0
    got = json.loads((tmp_path / "o" / "needle.json").read_text())["cells"][0]["answer_logprob"]
    case = PasskeySource().make(61, 30, seed=0, sample=0)
    want = float(score_answer(peft.eval(), case.ids, case.answer_at)[0].mean())  # the adapter, not merged
    assert abs(got - want) <= 1e-5


def test_without_matplotlib_json_only(one_process: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                      model_dir: Path, capsys: pytest.CaptureFixture) -> None:  # fmt: skip
    from hf_ring import plots

    monkeypatch.setattr(plots, "have_matplotlib", lambda: False)
    argv = ["eval", "needle", str(model_dir), "--lengths", "37", "--depths", "50", "--out", str(tmp_path)]
    assert main(argv) == 0
    assert (tmp_path / "needle.json").exists() and not (tmp_path / "needle.png").exists()
    assert "matplotlib is not installed: wrote" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="matplotlib is not installed"):
        main(["eval", "plot", one_process["out"], "--out", str(tmp_path / "cmp.png")])


def test_plot_draws_results_side_by_side(one_process: dict, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "cmp.png"
    both = [one_process["out"], one_process["out"]]
    assert main(["eval", "plot", *both, "--labels", "before,after", "--out", str(out)]) == 0
    assert out.stat().st_size > 0
    with pytest.raises(SystemExit, match="2 labels for 1 results"):
        main(["eval", "plot", one_process["out"], "--labels", "a,b", "--out", str(out)])
