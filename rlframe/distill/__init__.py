"""On-policy distillation's parts: served teachers score the student's samples
(:mod:`.teachers`), the training stack checks what they returned (:mod:`.alignment`), and
the reading trains the student (:mod:`.objectives`). The trainer holds them together as
:class:`rlframe.loop.distillation.Distillation`."""
