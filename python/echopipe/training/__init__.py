"""The pieces of ``echopipe train``; the public API is :mod:`echopipe.train`.

Data flows one way: :mod:`.config` -> :mod:`.trainer` -> (:mod:`.input`, the pipeline,
:mod:`.state`) -> :mod:`.report` and :mod:`.checkpoints`; nothing imports :mod:`.trainer` back.
"""
