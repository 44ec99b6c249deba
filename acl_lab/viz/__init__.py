"""Figures and widgets: :mod:`.style` (the one colour table, labels, reference lines), :mod:`.plots`
(matplotlib figures from result tables) and :mod:`.widgets` (ipywidgets on saved results).
Nothing here trains or imports the trainer (a test enforces it)."""
