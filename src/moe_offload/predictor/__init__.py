"""SeqMoE's seq2seq expert-activation predictor (SeqMoE §5) and its baselines.

- ``features``: the preprocessing Psi (§5.2) and per-request activation sequences read from traces.
- ``model``: ``SeqPredictor`` (Linear -> Mamba2 -> Linear) and ``PredictorSet`` (one per layer range), with the
  execution modes of §5.3 (training, prefill, one-step, recursive) and safetensors + JSON persistence.
- ``train``: ranking + KL loss, teacher forcing then scheduled sampling (§5.4).
- ``baselines``: first-order Markov cross-step predictor (Patterns-MoE, §2.2) and an oracle reading the trace.
- ``evaluate``: recall of the top-(k+3) predictions (§9.1/§9.4) and overhead.
- ``runtime``: ``PredictorRunner``, which runs a ``PredictorSet`` at its trigger layers during generation;
  ``attach``: attaching it to an engine (a forecast feed, or the predictors in their own process, ``lagged``).
- ``blend``, ``xl_weights``, ``xl_calibrate``: blending cross-layer forecasts (``cross_layer``) into SeqMoE's, the
  blend weights and their calibration.
"""
