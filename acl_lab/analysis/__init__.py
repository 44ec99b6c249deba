"""The analysis layer: reads saved runs and result tables, never trains (a test enforces it).

* :mod:`.stats` -- the one mean / sd / median / confidence-interval convention;
* :mod:`.runs` -- finding and tabulating finished runs (:func:`.runs.pick_run`);
* :mod:`.tables` -- result tables as text (``mean ± sd`` cells, markdown);
* :mod:`.gradients` -- the pilot study's angles and ACL-Grad's decisions;
* :mod:`.representations` -- label-embedding alignment and 2-D projections;
* :mod:`.exits` -- per-exit scores and early-exit trade-offs;
* :mod:`.sensitivity` -- how the dev metric moves with lambda.
"""
