"""Tools over what is below: bench, inspect (compiled-program analysis), gates, score, eval and the records they write."""
