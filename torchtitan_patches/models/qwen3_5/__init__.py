"""TorchTitan's Qwen3.5 (dense) under pipetune: a model that trains on CPU, its stage and encoder chunk.

The model is TorchTitan's ``qwen3_5`` (``Qwen35Model``: Gated DeltaNet linear-attention layers
beside gated full-attention layers with MRoPE, a ViT whose ``PatchMerger`` hands merged tokens to
the decoder). ``with_cpu_paths`` swaps in, config by config, subclasses that run where TorchTitan's
pieces do not:

* full attention: ``DocumentAttention`` (pipetune's varlen counterpart, per-document SDPA on CPU);
* ``CpuGatedDeltaNet`` / ``CpuGatedDeltaKernel``: on a CUDA tensor TorchTitan's own forward (fla's
  Triton kernels); otherwise the torch versions in ``gated_delta_cpu`` (same math, per document);
* ``DenseMaskQwen35VisionEncoder``: TorchTitan's encoder builds a FlexAttention ``BlockMask`` with
  a compiled ``create_block_mask`` inside ``forward`` (no CPU backward, compilation fails on CPU),
  so its ``forward`` is restated with a dense per-image mask for ``VisionMaskAttention`` (as
  ``VisionBlockAttention``, under the argument names TorchTitan's sharding config uses).

Parameters, initialisation and the state-dict adapter stay TorchTitan's. ``parallelize_for_pipetune``
is TorchTitan's ``parallelize_qwen3_5`` without FSDP: with data parallelism pipetune applies FSDP
(HSDP) itself, one unit per decoder block, the ViT with its merger, and the root
(``model_parts.for_pipetune``, ``runtime.data_parallel``). Tensor parallelism is the model's own
plan (sequence-parallel decoder, Gated DeltaNet and full attention sharded by heads, the ViT by its
linear layers), with one change: the ViT's output conversion moves to its merger
(``merger_converts_output``), which pipetune runs on its own.

``Qwen35Stage`` runs a model part on pipetune's packed micro-batch: the document metadata feeds
both the full-attention and the DeltaNet layers, and the 3D MRoPE positions (``mrope_positions``)
are built on the host from the documents and the image spans, on every stage (later stages get no
tokens). ``Qwen35EncoderChunk`` runs the ViT blocks on stage 0's images; the merger (the adapter
step) runs in stage 0's forward, so it trains while the ViT is frozen, as pipetune's projector does.

Limits: the co-located layout only (the separated layout is refused in ``titan.job_checks``),
dense flavours only. Data parallelism (FSDP) and tensor parallelism are tested beside 2 pipeline
stages, each on 4 gloo ranks and both on 8 (test_qwen3_5_scale_out: the unsplit model's
gradients), and HSDP (replicate 2 x shard 2) beside 2 stages on 8 (2 steps, the same gradients).
Images come at their own resolution (the loader's patch grids; ``block_order`` puts each image's
patches in the merger's order). On a GPU the ViT keeps its dense masks (no FlexAttention) and every
stage uploads its MRoPE positions each forward. Tried on one H100 (torch 2.11, Triton 3.6): fla
refuses the DeltaNet's gated backward there (Triton 3.4 to 3.7.1 computes it wrongly on Hopper, fla
issue 640; it asks for Triton >= 3.7.1 or tilelang), so Qwen3.5 trains on Hopper only with those;
``test_stages_on_a_gpu_give_the_cpu_float64_models_gradients`` checks the GPU path's gradients where
it runs. Planning prices the DeltaNet layers as linear attention (``spec``); the profiler
times ``gated_delta_net``, the model's own layer rebuilt from the planning shapes.
"""
