"""apex.contrib on ampfuse: only ``apex.contrib.clip_grad`` (its fused clip_grad_norm_, which
MONAI's and NVIDIA's training scripts import) and ``apex.contrib.optimizers`` (the BERT-era
FP16_Optimizer and fused optimizers). apex.contrib's other packages (fused attention,
group norm, sparsity, distributed optimizers, ...) fail to import with a message naming the
replacement (ampfuse.apex_compat)."""
