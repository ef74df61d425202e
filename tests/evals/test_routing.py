"""lit_softmoe.evals.routing: routing statistics equal hand-computed values on hand-built routers, the hook
sees the forward's routing, the figure is a real image, and `inspect-routing` writes PNG + JSON and
refuses bad input in one line."""
from __future__ import annotations

import json
import math

import PIL.Image
import pytest
import torch

from lit_softmoe.cli import main
from lit_softmoe.evals.routing import capture_routing, figure_size, plot_routing, routing_stats
from lit_softmoe.models.registry import create_image_tower
from lit_softmoe.models.tower_folder import save_tower
from lit_softmoe.nn.soft_moe import SoftMoE

EPS = 1e-6  # inside both of the layer's L2 normalizations: a unit vector's norm becomes sqrt(1 + 1e-6)


def _router(phi_columns, scale, dim):
    """A float64 SoftMoE whose slot s has phi = phi_columns[s] (one slot per expert)."""
    layer = SoftMoE(dim, len(phi_columns), 2, slots_per_expert=1, dtype=torch.float64)
    with torch.no_grad():
        layer.phi.copy_(torch.stack(phi_columns, dim=1).unsqueeze(-1))  # (d, n, 1)
        layer.scale.fill_(scale)
    return layer


def test_uniform_routing_has_maximal_entropies():
    m, dim = 6, 4
    layer = _router([torch.randn(dim, dtype=torch.float64) for _ in range(5)], scale=0.0, dim=dim)
    dispatch, combine = layer.routing_weights(torch.randn(1, m, dim, dtype=torch.float64))
    s = routing_stats(dispatch[0], combine[0])
    assert s["dispatch_entropy_mean"] == pytest.approx(math.log(6), abs=1e-12) == s["dispatch_entropy_max"]
    assert s["combine_entropy_mean"] == pytest.approx(math.log(5), abs=1e-12) == s["combine_entropy_max"]
    assert s["dispatch_max_weight_mean"] == pytest.approx(1 / 6)
    # All weights tie, and argmax takes the first token: every slot "points at" token 0.
    assert (s["distinct_argmax_tokens"], s["largest_argmax_group"]) == (1, 5)


def _entropy(probs):
    return -sum(p * math.log(p) for p in probs if p > 0)


def test_one_token_per_slot_is_near_zero_entropy_and_matches_the_closed_form():
    # Tokens e_0..e_3, slot j's phi = e_j: logit[i, j] = scale · δ_ij / (1 + 1e-6).
    eye = torch.eye(4, dtype=torch.float64)
    scale = 20.0
    layer = _router(list(eye), scale=scale, dim=4)
    dispatch, combine = layer.routing_weights(eye.unsqueeze(0))
    s = routing_stats(dispatch[0], combine[0])
    big = math.exp(scale / (1 + EPS))
    a, b = big / (big + 3), 1 / (big + 3)  # the matched token, each of the 3 others
    assert s["dispatch_entropy_mean"] == pytest.approx(_entropy([a, b, b, b]), rel=1e-9)
    assert s["combine_entropy_mean"] == pytest.approx(_entropy([a, b, b, b]), rel=1e-9)
    assert s["dispatch_entropy_mean"] < 1e-6
    assert (s["distinct_argmax_tokens"], s["largest_argmax_group"]) == (4, 1)


def test_k_slots_on_the_same_token():
    # 4 tokens e_0..e_3, 5 slots: slots 0, 1, 2 point at token 0, slot 3 at token 1, slot 4 at token 2.
    eye = torch.eye(4, dtype=torch.float64)
    scale = 2.0
    layer = _router([eye[0], eye[0], eye[0], eye[1], eye[2]], scale=scale, dim=4)
    dispatch, combine = layer.routing_weights(eye.unsqueeze(0))
    s = routing_stats(dispatch[0], combine[0])
    assert (s["distinct_argmax_tokens"], s["largest_argmax_group"]) == (3, 3)
    e = math.exp(scale / (1 + EPS))
    # Dispatch: each slot sees logits (e on its token, 0 on the 3 others): the same entropy for all 5.
    slot = _entropy([e / (e + 3)] + [1 / (e + 3)] * 3)
    assert s["dispatch_entropy_mean"] == pytest.approx(slot, rel=1e-9)
    # Combine, per token over the 5 slots: token 0 matches 3 slots, tokens 1 and 2 one each, token 3 none.
    token0 = _entropy([e / (3 * e + 2)] * 3 + [1 / (3 * e + 2)] * 2)
    token12 = _entropy([e / (e + 4)] + [1 / (e + 4)] * 4)
    assert s["combine_entropy_mean"] == pytest.approx((token0 + 2 * token12 + math.log(5)) / 4, rel=1e-9)


def test_capture_sees_the_weights_the_forward_uses_and_changes_nothing():
    torch.manual_seed(0)
    tower = create_image_tower("soft-test-4e", num_classes=10, moe_layers=(0, 1)).train()
    tower.blocks[1].mlp.noise_std = 1.0  # noise would make a training-mode capture differ; eval must be used
    x = torch.randn(3, 1, 28, 28)
    inputs = {}
    hooks = [tower.blocks[i].norm2.register_forward_hook(lambda m, a, o, i=i: inputs.__setitem__(i, o)) for i in (0, 1)]
    with torch.no_grad():
        expected_out = tower.eval()(x)
    for h in hooks:
        h.remove()
    tower.train()
    routing = capture_routing(tower, x)
    assert tower.training  # mode restored
    assert sorted(routing) == [0, 1]
    tower.eval()  # the reference: the layer's own routing_weights, without training noise
    for i in (0, 1):
        dispatch, combine = routing[i]
        want_d, want_c = tower.blocks[i].mlp.routing_weights(inputs[i])
        assert dispatch.shape == (3, 16, 4, 1) and torch.equal(dispatch, want_d) and torch.equal(combine, want_c)
    with torch.no_grad():
        assert torch.equal(tower.eval()(x), expected_out)
    assert not tower.blocks[0].mlp._forward_pre_hooks  # hooks removed


@pytest.mark.parametrize("slots", [3, 8])
def test_png_is_a_valid_image_of_the_documented_size(tmp_path, slots):
    dispatch = torch.softmax(torch.randn(16, 12), dim=0)  # (m=16 tokens, 12 slots)
    size = plot_routing(torch.rand(1, 28, 28), dispatch, list(range(slots)), (4, 4), tmp_path / "r.png", "title")
    assert size == figure_size(slots) == ((800, 260) if slots == 3 else (1000, 460))
    with PIL.Image.open(tmp_path / "r.png") as image:
        image.verify()
    with PIL.Image.open(tmp_path / "r.png") as image:
        assert image.format == "PNG" and image.size == size
        assert len(set(image.convert("L").getdata())) > 10  # something was drawn


def _fashion_like_image(path):
    # A 28×28 grayscale "garment": bright rectangle on black (no dataset needed in CI).
    image = PIL.Image.new("L", (28, 28))
    image.paste(200, (6, 4, 22, 24))
    image.save(path)
    return path


def test_cli_writes_png_and_json_and_refuses_bad_input(tmp_path, capsys):
    torch.manual_seed(0)
    tower = create_image_tower("soft-test-4e", num_classes=3)
    save_tower(tmp_path / "tower", tower, extra={"preprocess": {"image_size": 28, "mean": [0.3], "std": [0.35]},
                                                 "classnames": ["a", "b", "c"]})
    image = _fashion_like_image(tmp_path / "img.png")
    out = tmp_path / "out" / "routing.png"
    assert main(["inspect-routing", "--tower", str(tmp_path / "tower"), "--image", str(image), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "dispatch H (max)" in printed and "2.773" in printed  # log 16 tokens
    report = json.loads(out.with_suffix(".json").read_text())
    assert [layer["block"] for layer in report["layers"]] == [1]
    assert report["plotted"] == {"block": 1, "slots": [0, 1, 2, 3], "png": str(out), "size": [1000, 260]}
    assert report["prediction"] in ("a", "b", "c")
    stats = report["layers"][0]
    assert stats["tokens"] == 16 and stats["slots"] == 4
    assert 0 < stats["dispatch_entropy_mean"] <= math.log(16) + 1e-9
    assert 1 <= stats["distinct_argmax_tokens"] <= 4
    with PIL.Image.open(out) as png:
        assert png.size == (1000, 260)

    preprocess = {"image_size": 28, "mean": 0.5, "std": 0.5}
    save_tower(tmp_path / "dense", create_image_tower("vit-test"), extra={"preprocess": preprocess})
    (tmp_path / "broken.png").write_text("not an image")
    cases = [(["--tower", str(tmp_path / "nothing")], "not a tower checkpoint"),
             (["--tower", str(tmp_path / "dense")], "has no Soft MoE block"),
             (["--tower", str(tmp_path / "tower"), "--layer", "7"],
              "--layer 7 is out of range: the tower has 2 blocks"),
             (["--tower", str(tmp_path / "tower"), "--layer", "0"], "block 0 has a dense MLP"),
             (["--tower", str(tmp_path / "tower"), "--slots", "0"], "--slots must be at least 1"),
             (["--tower", str(tmp_path / "tower"), "--image", str(tmp_path / "broken.png")], "cannot read"),
             (["--tower", str(tmp_path / "tower"), "--image", str(tmp_path / "missing.png")], "cannot read")]
    for argv, message in cases:
        if "--image" not in argv:
            argv = [*argv, "--image", str(image)]
        assert main(["inspect-routing", *argv, "--out", str(tmp_path / "bad.png")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (argv, err)
    assert not (tmp_path / "bad.png").exists()


@pytest.fixture(scope="module")
def tower_and_image(tmp_path_factory):
    root = tmp_path_factory.mktemp("routing")
    torch.manual_seed(0)
    save_tower(root / "tower", create_image_tower("soft-test-4e", num_classes=3),
               extra={"preprocess": {"image_size": 28, "mean": [0.3], "std": [0.35]}, "classnames": ["a", "b", "c"]})
    PIL.Image.new("L", (28, 28), 120).save(root / "img.png")
    return root / "tower", root / "img.png"


@pytest.mark.parametrize("name, message", [("routing.json", "cannot write a .json figure"),
                                           ("routing.txt", "cannot write a .txt figure"),
                                           ("routing", "has no file suffix")])
def test_out_that_is_not_an_image_file_is_one_line(tower_and_image, tmp_path, capsys, name, message):
    tower, image = tower_and_image
    code = main(["inspect-routing", "--tower", str(tower), "--image", str(image), "--out", str(tmp_path / name)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err and "routing.png" in err, err
    assert list(tmp_path.iterdir()) == []


def test_out_that_cannot_be_written_is_one_line(tower_and_image, tmp_path, capsys):
    tower, image = tower_and_image
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "a-folder").mkdir()
    for out, message in [(tmp_path / "a-file" / "routing.png", "is a file, not a folder"),
                         (tmp_path / "a-folder", "is a folder")]:
        code = main(["inspect-routing", "--tower", str(tower), "--image", str(image), "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "a-folder"]


def test_pdf_and_svg_figures_still_work(tower_and_image, tmp_path, capsys):
    tower, image = tower_and_image
    for name in ("routing.pdf", "routing.svg"):
        argv = ["inspect-routing", "--tower", str(tower), "--image", str(image), "--out", str(tmp_path / name)]
        assert main(argv) == 0
        assert (tmp_path / name).stat().st_size > 0 and (tmp_path / "routing.json").is_file()
    capsys.readouterr()


def test_a_full_disk_while_drawing_is_one_line_naming_the_figure(tower_and_image, tmp_path, capsys, monkeypatch):
    """matplotlib's write() names no path; the figure was written in place, so a kill left half a PNG."""
    import errno

    from matplotlib.figure import Figure

    def savefig(self, fname, **kwargs):
        open(fname, "wb").write(b"\x89PNG half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", savefig)
    tower, image = tower_and_image
    out = tmp_path / "routing.png"
    code = main(["inspect-routing", "--tower", str(tower), "--image", str(image), "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"lit-softmoe inspect-routing: error: no space left on the device while writing "
                                 f"{out}; free some space (or write to another disk) and rerun the same command"]
    assert list(tmp_path.iterdir()) == []  # no half figure under its name


def test_a_run_killed_between_the_figure_and_its_statistics_leaves_no_other_images_statistics(
        tower_and_image, tmp_path, monkeypatch):
    """Each file was renamed into place alone: a kill after the new figure's rename left it beside the statistics
    of the image an earlier run drew."""
    from lit_softmoe.evals import routing
    tower, image = tower_and_image
    other = tmp_path / "other.png"
    PIL.Image.new("L", (28, 28), 30).save(other)
    out = tmp_path / "routing.png"
    routing.inspect_routing(tower, image, out)
    assert json.loads(out.with_suffix(".json").read_text())["image"] == str(image)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # as a kill between the two renames would stop it

    monkeypatch.setattr(routing, "write_text_atomic", killed)
    with pytest.raises(KeyboardInterrupt):
        routing.inspect_routing(tower, other, out)
    assert out.is_file() and not out.with_suffix(".json").exists()  # the new figure, and no statistics of another
    monkeypatch.undo()
    routing.inspect_routing(tower, other, out)  # the rerun writes the pair
    assert json.loads(out.with_suffix(".json").read_text())["image"] == str(other)


def test_a_tower_resized_to_another_image_size_says_so(tower_and_image, tmp_path, capsys):
    """A tower whose preprocess.image_size is 56 where it was built for 28 was inspected on 64 tokens without a
    word (a deliberate resolution change: it runs, and the line and the report say so)."""
    from towers import resized_copy
    tower, image = tower_and_image
    resized, _ = resized_copy(tower, tmp_path / "tower-56", size=56)
    out = tmp_path / "routing.png"
    assert main(["inspect-routing", "--tower", str(resized), "--image", str(image), "--out", str(out)]) == 0
    note = "images at 56 px (preprocess.image_size), not the 28 px the tower was built for"
    assert capsys.readouterr().out.rstrip().endswith(f"; {note}")
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["resolution_change"] == note and report["layers"][0]["tokens"] == 64
    assert main(["inspect-routing", "--tower", str(tower), "--image", str(image), "--out", str(out)]) == 0
    assert "px the tower was built for" not in capsys.readouterr().out
    assert json.loads(out.with_suffix(".json").read_text())["resolution_change"] is None
