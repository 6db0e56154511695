"""The benchmarks' figures, one module per benchmark family; ``python -m benchmarks.plot`` draws them
all from the long tables in ``benchmarks/results`` (``benchmarks.plot.FIGURES``)."""
