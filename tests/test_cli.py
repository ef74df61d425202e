"""lit_softmoe.cli: what the command line itself does: closing lines from the main process only, an
interrupt on its own line, a --benchmarks that names nothing refused, exit code 2 when nothing was evaluated."""
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import PIL.Image
import pytest

from cli_errors import one_line_error
from launch import python_command
from lit_softmoe.cli import main
from lit_softmoe.errors import UserError


def test_train_says_where_the_model_went_with_or_without_an_eval(tmp_path, capsys, monkeypatch):
    import lit_softmoe.train.lit as lit
    config = tmp_path / "lit.yaml"
    config.write_text(f"run_dir: {tmp_path / 'run'}\n")
    monkeypatch.setattr(lit, "train_lit", lambda cfg: {"steps": 3})  # eval.shards= : no zero-shot score
    assert main(["train", "--config", str(config)]) == 0
    assert capsys.readouterr().out.strip() == f"model saved to {tmp_path / 'run'}/model"
    monkeypatch.setattr(lit, "train_lit", lambda cfg: {"zeroshot_top1": 0.5})
    assert main(["train", "--config", str(config)]) == 0
    assert capsys.readouterr().out.strip() == f"zero-shot top-1 0.5000; model saved to {tmp_path / 'run'}/model"


@pytest.mark.parametrize("command, function, result, line", [
    ("train", "lit_softmoe.train.lit.train_lit", {"zeroshot_top1": 0.5}, "zero-shot top-1 0.5000; model saved to"),
    ("pretrain", "lit_softmoe.train.pretrain.pretrain", {"test_top1": 0.25}, "test top-1 0.2500; tower saved to"),
])
def test_the_closing_line_comes_from_the_main_process_only(tmp_path, capsys, monkeypatch, command, function,
                                                           result, line):
    # Under torchrun every process returns from training; only rank 0 says so.
    config = tmp_path / "c.yaml"
    config.write_text(f"run_dir: {tmp_path / 'run'}\n")
    monkeypatch.setattr(function, lambda cfg: result)
    monkeypatch.setenv("RANK", "0")
    assert main([command, "--config", str(config)]) == 0
    assert capsys.readouterr().out.startswith(line)
    monkeypatch.setenv("RANK", "3")
    assert main([command, "--config", str(config)]) == 0
    assert capsys.readouterr().out == ""


def test_an_interrupt_is_reported_on_its_own_line(tmp_path, capsys, monkeypatch):
    import lit_softmoe.train.lit as lit
    config = tmp_path / "lit.yaml"
    config.write_text(f"run_dir: {tmp_path / 'run'}\n")

    def interrupted(cfg):
        print("  12%|#  | 108/468", end="", file=__import__("sys").stderr)  # a progress bar mid-line
        raise KeyboardInterrupt
    monkeypatch.setattr(lit, "train_lit", interrupted)
    assert main(["train", "--config", str(config)]) == 130
    err = capsys.readouterr().err
    assert err.endswith("108/468\nlit-softmoe train: interrupted; rerun the same command to resume\n")


@pytest.mark.parametrize("ends", ["well", "in a mistake"])
def test_a_distributed_command_destroys_its_process_group_when_it_ends_well(tmp_path, capsys, monkeypatch, ends):
    # Left to interpreter exit, Gloo's threads could abort a process after its finished run (SIGABRT,
    # "terminate called without an active exception"); after an error the others may still be in a collective.
    import torch.distributed as dist

    import lit_softmoe.train.lit as lit
    config = tmp_path / "lit.yaml"
    config.write_text(f"run_dir: {tmp_path / 'run'}\n")

    def trained(cfg):
        assert dist.is_initialized()  # the command ran inside the launch's group
        if ends != "well":
            raise UserError("a mistake")
        return {}
    monkeypatch.setattr(lit, "train_lit", trained)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert main(["train", "--config", str(config)]) == (0 if ends == "well" else 2)
        assert dist.is_initialized() == (ends != "well")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_eval_where_every_benchmark_was_skipped_exits_2(tmp_path, capsys, monkeypatch, suite):
    from lit_softmoe.evals import suite as suite_module
    skipped = {"benchmark": "fashion-mnist", "task": "classification", "status": "skipped",
               "reason": "fashion-mnist data folder not found at data/fashion-mnist"}
    monkeypatch.setattr(suite_module, "run_suite", lambda *a, **k: {"suite": "s", "evaluated": 0, "paths": {},
                                                                   "results": [skipped]})
    assert main(["eval", "--model", str(tmp_path), "--suite", suite]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == ("lit-softmoe eval: error: nothing evaluated, so no results were written: "
                                    "fashion-mnist: fashion-mnist data folder not found at data/fashion-mnist")
    assert "not found at data/fashion-mnist" in captured.out and "| benchmark" not in captured.out


@pytest.mark.parametrize("value", ["", ",", " , "])
def test_eval_benchmarks_that_name_nothing_are_refused(tmp_path, capsys, monkeypatch, value):
    # An empty subset ran the whole suite without a word.
    from lit_softmoe.evals import suite as suite_module
    monkeypatch.setattr(suite_module, "run_suite", lambda *a, **k: pytest.fail("the suite ran"))
    suite = tmp_path / "suite.yaml"
    suite.write_text("name: s\n")
    line = one_line_error(capsys, ["eval", "--model", str(tmp_path), "--suite", str(suite), "--benchmarks", value])
    assert line == (f"lit-softmoe eval: error: --benchmarks {value!r} names no benchmark; give a comma-separated "
                    "list such as fashion-mnist,cifar10, or leave it out for the whole suite")


def _modules_after_cli(argv: list[str]) -> list[str]:
    """Module names loaded by running `lit-softmoe ARGV` in a fresh interpreter (help exits: caught)."""
    script = (f"import sys\nsys.argv = ['lit-softmoe', *{argv!r}]\nfrom lit_softmoe.cli import main\n"
              "try:\n    main()\nexcept SystemExit:\n    pass\n"
              "import json\nprint(json.dumps(sorted(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["eval", "--help"], ["pretrain", "--help"],
                                  ["data", "from-folder", "--help"], ["export", "--help"]])
def test_help_imports_no_torch(argv):
    loaded = _modules_after_cli(argv)
    assert "lit_softmoe.cli" in loaded
    assert not [m for m in loaded if m.split(".")[0] in ("torch", "torchvision", "accelerate", "webdataset")]


def test_models_lists_the_towers_without_the_training_code():
    loaded = _modules_after_cli(["models"])
    assert "lit_softmoe.models.registry" in loaded
    assert not [m for m in loaded if m.startswith(("lit_softmoe.train", "accelerate", "webdataset"))]


def test_other_libraries_warnings_show_with_verbose_only(tmp_path, monkeypatch):
    """A library's warning (here one attributed to PIL) stays out of a command's output unless --verbose;
    lit-softmoe's own warnings always show."""
    import warnings

    from lit_softmoe.data import sample_encoding
    real = sample_encoding.prepare_image

    def noisy(*args, **kwargs):
        warnings.warn_explicit("a library's notice", UserWarning, "PIL/Image.py", 1, module="PIL.Image")
        warnings.warn_explicit("our own warning", UserWarning, "lit_softmoe/data/writers.py", 1,
                               module="lit_softmoe.data.writers")
        return real(*args, **kwargs)

    monkeypatch.setattr(sample_encoding, "prepare_image", noisy)
    src = tmp_path / "src"
    src.mkdir()
    PIL.Image.new("L", (8, 8), 7).save(src / "a.png")
    (src / "a.txt").write_text("a gray square")
    for flags, shown in (([], ["our own warning"]), (["--verbose"], ["a library's notice", "our own warning"])):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert main(["data", "from-folder", str(src), "--out", str(tmp_path / "out" / str(flags)), *flags]) == 0
        assert sorted(str(w.message) for w in caught) == shown


def test_lit_softmoe_models_piped_into_head_ends_quietly():
    done = subprocess.run(f"{sys.executable} -m lit_softmoe.cli models | head -1", shell=True, capture_output=True,
                          text=True, timeout=300)
    assert done.stdout.count("\n") == 1 and "BrokenPipeError" not in done.stderr and "Traceback" not in done.stderr


def _five_captioned_images(src):
    src.mkdir()
    for i in range(5):
        PIL.Image.new("L", (8, 8), 40 * i).save(src / f"{i}.png")
        (src / f"{i}.txt").write_text(f"gray square {i}")
    return src


def test_a_full_disk_while_data_writes_shards_is_one_line_and_the_rerun_completes(tmp_path, capsys, monkeypatch):
    """ENOSPC ended `data` in a traceback. Now one line naming the file, exit code 2, no temporary shard
    and no sizes.json left (a reader would take the split for complete), and the rerun writes it all."""
    import errno
    import tarfile
    real_addfile, failed_on = tarfile.TarFile.addfile, []

    def addfile(self, *args, **kwargs):
        if (out / "train" / "0.tar").exists() and not failed_on:  # shard 0 done, shard 1 being written
            failed_on.extend(str(p) for p in (out / "train").glob(".*.partial"))  # the shard being written
            raise OSError(errno.ENOSPC, "No space left on device", failed_on[0])
        return real_addfile(self, *args, **kwargs)

    monkeypatch.setattr(tarfile.TarFile, "addfile", addfile)
    src, out = _five_captioned_images(tmp_path / "src"), tmp_path / "out"
    argv = ["data", "from-folder", str(src), "--out", str(out), "--samples-per-shard", "2"]
    line = one_line_error(capsys, argv)
    assert [Path(p).name for p in failed_on] == [f".1.tar.{os.getpid()}.partial"]
    assert line == (f"lit-softmoe data: error: no space left on the device while writing {failed_on[0]}; free some "
                    "space (or write to another disk) and rerun the same command")
    split = out / "train"
    assert not list(split.glob(".*partial")) and not (split / "sizes.json").exists()
    assert not (split / "nshards.txt").exists()
    assert "summary" not in json.loads((split / "manifest.json").read_text())  # not marked complete
    monkeypatch.setattr(tarfile.TarFile, "addfile", real_addfile)  # space again
    assert main(argv) == 0
    assert json.loads((split / "sizes.json").read_text()) == {"0.tar": 2, "1.tar": 2, "2.tar": 1}


@pytest.mark.parametrize("how", ["in safetensors' words", "ENOSPC without a path", "ENOSPC with a path"])
def test_a_full_disk_while_exporting_is_one_line_naming_the_path(run, tmp_path, capsys, monkeypatch, how):
    """safetensors reports a full disk in its own error, without errno or path, and a write() on an open
    file without the path: the line said no path, though docs/reliability.md promises one."""
    import errno

    from safetensors import SafetensorError

    from lit_softmoe.export import pair
    own = tmp_path / "export-disk" / "open_clip_model.safetensors"

    def full(*args, **kwargs):
        if how == "in safetensors' words":
            raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                                  '"No space left on device" })')
        raise OSError(errno.ENOSPC, "No space left on device", *([str(own)] if how.endswith("with a path") else []))

    monkeypatch.setattr(pair, "save_file", full)
    line = one_line_error(capsys, ["export", str(run), "--out", str(tmp_path / "export")])
    where = own if how.endswith("with a path") else tmp_path / "export"
    assert line == (f"lit-softmoe export: error: no space left on the device while writing {where}; free some space "
                    "(or write to another disk) and rerun the same command")
    assert not (tmp_path / "export").exists() and list(tmp_path.iterdir()) == []


def test_a_full_disk_without_a_path_while_data_writes_shards_names_the_dataset(tmp_path, capsys, monkeypatch):
    """The tar stream's write() names no path: the line names the --out being written."""
    import errno

    def addfile(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tarfile.TarFile, "addfile", addfile)
    src, out = _five_captioned_images(tmp_path / "src"), tmp_path / "out"
    line = one_line_error(capsys, ["data", "from-folder", str(src), "--out", str(out)])
    assert line == (f"lit-softmoe data: error: no space left on the device while writing {out}; free some space "
                    "(or write to another disk) and rerun the same command")
    assert not (out / "train" / "sizes.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("command", ["train", "pretrain"])
def test_memory_running_out_in_training_is_one_line_naming_the_run_and_its_plan(data, tmp_path, capsys, command):
    """`text.width=16384` under a memory limit ended in torch's `RuntimeError: ... can't allocate memory`
    traceback. Run in a process of its own, its address space capped at 6 GiB: the process maps 3-4 GiB before the
    run starts (torch and the libraries it imported), and the first 16384-wide layer needs 3 GiB more (the higher
    the cap, the more layers are drawn before it fails)."""
    import resource
    import shlex

    def cap_memory():
        resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))

    (tmp_path / "c.yaml").write_text("{}\n")
    if command == "train":
        overrides = [f"image_tower={data / 'tower'}", f"data.train={data / 'features' / 'train'}",
                     f"run_dir={tmp_path / 'run'}", "text.width=16384", "text.heads=16", "data.workers=0",
                     "batch_size=64"]
        size = f"text tower 16384 wide × 12 layers against {data / 'tower'}, batch 64"
    else:
        overrides = [f"data.train={data / 'fmnist' / 'train'}", f"data.test={data / 'fmnist' / 'test'}",
                     f"run_dir={tmp_path / 'run'}", "tower.name=soft-test-4e", "tower.options.width=16384",
                     "tower.options.mlp_dim=65536", "data.workers=0", "batch_size=64"]
        size = "tower soft-test-4e, width=16384, mlp_dim=65536, batch 64"
    result = subprocess.run([*python_command(), "-m", "lit_softmoe.cli", command, "--config", str(tmp_path / "c.yaml"),
                             *overrides], capture_output=True, text=True, preexec_fn=cap_memory)
    assert result.returncode == 2, result.stderr[-3000:]
    plan = shlex.join(["lit-softmoe", command, "--config", str(tmp_path / "c.yaml"), *overrides, "--plan"])
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"lit-softmoe {command}: error: out of memory on the CPU (an allocation of "), line
    assert line.endswith(f" GiB failed) in this run ({size}); `{plan}` shows what it needs per device: lower "
                         "batch_size (raise accum_steps to keep it), or set grad_checkpointing=true, precision=bf16 "
                         "(on a GPU) or sharding=fsdp over more GPUs"), line
    assert "Traceback" not in result.stderr
    # The command it names plans this very run (without the cap: the plan builds nothing, on the meta device).
    assert main(shlex.split(plan)[1:]) == 0
    planned = capsys.readouterr().out
    assert planned.startswith("memory plan: ") and "batch 64 on 1 GPU" in planned, planned


def test_memory_running_out_on_a_gpu_is_one_line_naming_the_lever(tmp_path, capsys, monkeypatch):
    """CUDA's out-of-memory error (torch.OutOfMemoryError, in torch's own words) in a command without a run."""
    import torch

    from lit_softmoe.train import embed

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                     "79.11 GiB of which 1.06 GiB is free.")

    monkeypatch.setattr(embed, "embed_shards", out_of_memory)
    line = one_line_error(capsys, ["embed", "--tower", "t", "--shards", "s", "--out", str(tmp_path / "out")])
    assert line == ("lit-softmoe embed: error: out of memory on the GPU (an allocation of 2.00 GiB failed); lower the "
                    "batch size (--batch-size), or run on a machine with more memory")


def test_data_from_folder_writes_captions_from_class_names(tmp_path, capsys):
    src, out = tmp_path / "src", tmp_path / "out"
    for name in ("cat", "dog"):
        (src / name).mkdir(parents=True)
        PIL.Image.new("L", (8, 8), 7).save(src / name / "0.png")
    assert main(["data", "from-folder", str(src), "--out", str(out), "--caption-templates", "default"]) == 0
    assert capsys.readouterr().out.startswith(f"written 2 samples in 1 shard to {out / 'train'}")
    with tarfile.open(out / "train" / "0.tar") as tar:
        names = tar.getnames()
    assert names == ["cat/0.cls", "cat/0.json", "cat/0.png", "cat/0.txt", "dog/0.cls", "dog/0.json", "dog/0.png",
                     "dog/0.txt"]
    assert (out / "zeroshot_classification_templates.txt").read_text().count("{c}") == 80


@pytest.mark.parametrize("templates, layout, message", [
    ("missing.txt", "classes", "caption templates 'missing.txt': no such file, and not a shipped template set; "
                               "give a file with one template per line writing the class name as {c}"),
    ("plain.txt", "classes", "caption templates plain.txt: template 'a photo' has no {c}, so every class "
                             "would get the same prompt; write the class name as {c}"),
    ("empty.txt", "classes", "caption templates empty.txt holds no templates; give one prompt per line"),
    ("default", "captions", "caption templates write captions from class folder names, but {tmp}/src is read in "
                            "the captions layout; pass --layout classes, or drop --caption-templates"),
], ids=["missing", "no placeholder", "empty", "captions layout"])
def test_data_from_folder_caption_template_mistakes_are_one_line(tmp_path, capsys, monkeypatch, templates, layout,
                                                                 message):
    monkeypatch.chdir(tmp_path)  # the templates files are named as a user in that folder names them
    (tmp_path / "plain.txt").write_text("a photo\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "src" / "cat").mkdir(parents=True)
    PIL.Image.new("L", (8, 8), 7).save(tmp_path / "src" / "cat" / "0.png")
    line = one_line_error(capsys, ["data", "from-folder", str(tmp_path / "src"), "--out", str(tmp_path / "out"),
                                    "--layout", layout, "--caption-templates", templates])
    assert line.startswith("lit-softmoe data: error: " + message.format(tmp=tmp_path, c="{c}"))
    assert not (tmp_path / "out").exists()
