"""Accuracy harness: OSCAR vs BF16, INT4, naive INT2, QuaRot-INT2 and KIVI-2 on real models and text."""
