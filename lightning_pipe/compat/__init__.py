"""The only place lightning-pipe touches private names of torch, torchmetrics and Lightning.

One module per library. Every function here wraps one private use, says what it is for, which public API would
replace it, and which versions were checked. ``tests/test_architecture.py`` fails if a private name of these libraries
(or another module's underscore name) is used anywhere else in the package.
"""
