"""The lab layer: what composes training with analysis for the notebooks -- notebook helpers
(:mod:`.notebook`), the comparisons (:mod:`.plans`), training many runs (:mod:`.experiments`),
the live-run widget (:mod:`.live`), the papermill batch runner (:mod:`.batch`) and the evidence
pipeline (:mod:`.evidence`)."""
