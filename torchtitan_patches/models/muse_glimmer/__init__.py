"""Muse Glimmer under pipetune: its spec with CPU attention and size variants, planning shapes
(``spec``), stage and encoder chunks (``stages``), dense-mask vision encoder (``vision``) and the
TP plan's missing input conversion (``tp_fix``)."""
