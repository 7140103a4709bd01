"""The commands' work over what is below: bench, inspect (compiles the programs; analysis/ reads them), gates, score, eval and the records they write."""
