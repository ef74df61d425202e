"""Small helpers every layer uses: atomic writes, device and precision, output-path checks, hashing.

They import nothing of lit_softmoe but `errors`, so any module can use them.
"""
