"""lit_softmoe.errors: the words a library message names a setting in, the caller's (`setting`)."""
from lit_softmoe.errors import setting, spelled


def test_a_setting_is_named_as_the_caller_knows_it():
    flags = {"out_dir": "--out", "overwrite": "--overwrite", "layout": "--layout"}
    assert setting(flags, "out_dir") == "--out"
    assert setting(flags, "layout", "classes") == "--layout classes"
    assert setting(flags, "overwrite", True) == "--overwrite"  # a switch: the flag alone
    # A Python caller (no names, or a parameter not among them) reads the parameter's own name.
    assert setting(None, "out_dir") == "out_dir"
    assert setting(flags, "split", "train") == "split=train"
    assert setting({}, "overwrite", True) == "overwrite=True"
    assert spelled("jpeg_decoder", "gpu") == "jpeg_decoder=gpu"
    assert spelled("--jpeg-decoder", "gpu") == "--jpeg-decoder gpu"
