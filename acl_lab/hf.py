"""ACL inside the Hugging Face ``Trainer``: :class:`ACLTrainer`, a drop-in subclass.

``ACLTrainer(model=..., args=..., train_dataset=..., objective="acl")`` trains any
``AutoModelForSequenceClassification`` with ``ce``, ``ce+scl``, ``acl-embed`` or ``acl``
(PAPER.md) and otherwise behaves as the ``Trainer`` it extends: same arguments, data
collation, optimiser, scheduler, mixed precision, gradient accumulation, callbacks,
checkpoints and ``report_to``. Multi-exit training stays in acl_lab's own model.

Where the vectors come from (the rule, the same for BERT, RoBERTa, DistilBERT, DeBERTa,
ELECTRA, ALBERT, XLM-R... without per-model code):

1. The *classifier layer* is ``classifier=`` (a dotted module name such as
   ``"classifier.out_proj"``) when given; otherwise the LAST ``torch.nn.Linear`` in
   ``model.named_modules()`` order whose ``out_features`` equals ``model.config.num_labels``.
   Hugging Face registers the head after the encoder, so that is BERT's ``classifier``,
   RoBERTa's / ELECTRA's ``classifier.out_proj``, DistilBERT's and DeBERTa's ``classifier``.
2. The *sample representation* h_i is that layer's input, captured by a forward hook
   during the training forward pass (BERT: the pooled output after dropout; RoBERTa: the
   output of ``classifier.dense`` + tanh after dropout). It must be a 2-D ``[batch, d]``.
3. The *label embeddings* e_c are that layer's weight rows (``weight[c]``), as in PAPER.md.
4. On the first training batch the layer's output is checked to BE the model's logits
   (logits = W h + b); a head that post-processes them (pools over tokens after the
   linear, rescales...) is refused with an :class:`AclLabError`, as is a model with no
   such layer. Both errors say to pass ``classifier=``.

The objective splits in two halves as in :mod:`acl_lab.objectives`: ``ce`` is the model's
own loss as the plain ``Trainer``'s ``compute_loss`` gives it (label smoothing and
``compute_loss_func`` included), ``aux = lam * SCL`` (``ce+scl``) or ``lam * ACL-Embed``
(``acl-embed``, ``acl``) from :mod:`acl_lab.losses`; ``acl`` gates ``aux`` with
:class:`acl_lab.grad.ACLGrad` (``acl_grad=True`` puts the gate on ``ce+scl`` or
``acl-embed`` too). The gate needs two gradients, so :meth:`ACLTrainer.training_step`
is overridden, not only ``compute_loss``; it applies exactly the scaling
``accelerator.backward`` would (its accumulation factor, the fp16 ``GradScaler``). With
gradient accumulation every part is a per-micro-batch mean divided by the number of
micro-batches, so a step is the mean over the accumulated batch for every objective alike.
(The plain ``Trainer`` of transformers 5.x passes ``num_items_in_batch`` to models that
accept ``**kwargs``; ``BertForSequenceClassification`` accepts and ignores it, so the plain
Trainer then SUMS the micro-batch means: with accumulation, ``ACLTrainer(objective="ce")``
and a plain ``Trainer`` differ by that factor. Without accumulation they are identical.)

Logged through the Trainer's own ``log`` (so they reach TensorBoard, W&B or whatever
``report_to`` names), averaged over the optimizer steps since the last log like ``loss``:
``ce`` and ``aux`` (``loss = ce + aux``), and with the gate ``cos``, ``angle`` (degrees,
mean over micro-batches) and ``kept`` (the share of micro-batches whose aux term was
kept). Every decision is also kept in :attr:`ACLTrainer.gate_history`.

Under ``torchrun`` / ``accelerate launch`` (DDP) the representations and labels are
gathered with :func:`acl_lab.distributed.gather_with_grad`, so the contrastive term is the
global-batch loss, and the gate decides once on global gradients
(``ACLGrad(reduce=acl_lab.distributed.all_reduce_mean)``, the kit's DDP gate). The gated
step runs forward and backward inside ``no_sync()`` (DDP's reducer cannot take two
backward passes of one forward, and arms its hooks in the forward pass) and the gate
averages the gradients itself: for the exact scope g_CE and g_aux in one all-reduce of
twice the gradient size per micro-batch, instead of DDP's one gradient all-reduce per
optimizer step; for the cheap scopes their small vectors (or three sums) and then the
one combined gradient. DeepSpeed, FSDP and ``DataParallel`` (several
GPUs in one process) are refused for the gated objective / contrastive objectives.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch
from torch import Tensor, nn

try:
    from transformers import Trainer
except ImportError as exc:  # pragma: no cover - transformers is a core dependency
    raise ImportError("acl_lab.hf needs transformers and accelerate: pip install 'acl_lab[hf]'") from exc

from .distributed import all_reduce_mean, gather_with_grad, is_distributed
from .errors import AclLabError, bad_value
from .grad import ACLGrad
from .losses import ANCHORS, acl_embed_loss, supcon_loss

OBJECTIVES = ("ce", "ce+scl", "acl-embed", "acl")
SCOPES = ("all", "head", "repr")  # "all" is the paper's; "head" and "repr" are this kit's approximations
RULE = ("the last torch.nn.Linear in model.named_modules() whose out_features equals model.config.num_labels, "
        "whose input is the [batch, d] sample representation and whose output is the logits")


def find_classifier(model: nn.Module, classifier: str | None = None) -> tuple[str, nn.Linear]:
    """``(name, layer)`` of the final linear classifier layer of ``model`` by the module's rule.

    ``classifier`` (a dotted module name) overrides the search. Raises :class:`AclLabError`
    when the named module does not exist or is not an ``nn.Linear``, or when no layer fits.
    """
    modules = dict(model.named_modules())
    if classifier is not None:
        layer = modules.get(classifier)
        if not isinstance(layer, nn.Linear):
            found = "no such module" if layer is None else f"a {type(layer).__name__}"
            linears = [n for n, m in modules.items() if isinstance(m, nn.Linear)][-4:]
            raise AclLabError(
                f"classifier={classifier!r} is {found} in {type(model).__name__}; it must name the torch.nn.Linear "
                f"that maps the sample representation to the logits. Fix: pass one of its last linear layers, "
                f"e.g. {linears}."
            )
        return classifier, layer
    num_labels = getattr(getattr(model, "config", None), "num_labels", None)
    if not isinstance(num_labels, int):
        raise AclLabError(
            f"{type(model).__name__} has no config.num_labels, so its classifier layer cannot be found by the rule "
            f"({RULE}). Fix: pass classifier='<dotted name of that nn.Linear>'."
        )
    candidates = [(n, m) for n, m in modules.items() if isinstance(m, nn.Linear) and m.out_features == num_labels]
    if not candidates:
        raise AclLabError(
            f"ACLTrainer cannot find the classifier layer of {type(model).__name__}: no torch.nn.Linear with "
            f"out_features == num_labels ({num_labels}). The rule is {RULE}; the label embeddings are its weight rows. "
            "Fix: give the model such a head (any AutoModelForSequenceClassification has one), or pass "
            "classifier='<dotted name of the nn.Linear that outputs the logits>'."
        )
    return candidates[-1]


class ACLTrainer(Trainer):
    """``transformers.Trainer`` that trains with CE, CE+SCL, ACL-Embed or ACL (ACL-Embed + ACL-Grad).

    Args (besides every ``Trainer`` argument, passed through):
        objective: ``"ce"``, ``"ce+scl"``, ``"acl-embed"`` or ``"acl"``.
        lam: lambda, the weight of the contrastive term (>= 0).
        temperature: tau of SCL / ACL-Embed (> 0).
        anchors: ACL-Embed anchors, ``"all"`` (samples and label embeddings) or ``"samples"``.
        threshold: ACL-Grad angle threshold in degrees, in [0, 180] (default 90).
        scope: where ACL-Grad measures the angle: ``"all"`` trainable parameters (the paper's
            definition), or the approximations ``"head"`` (the classifier layer's weight and bias)
            and ``"repr"`` (the gradient w.r.t. the captured representations).
        acl_grad: gate on/off; ``None`` = on for ``acl`` only.
        classifier: dotted name of the classifier layer, overriding the rule (module docstring).
    """

    def __init__(self, *args: Any, objective: str = "acl", lam: float = 0.1, temperature: float = 0.1,
                 anchors: str = "all", threshold: float = 90.0, scope: str = "all", acl_grad: bool | None = None,
                 classifier: str | None = None, **kwargs: Any) -> None:
        if objective not in OBJECTIVES:
            raise bad_value("objective", objective, OBJECTIVES, "multi-exit objectives need acl_lab's own trainer "
                            "(python -m acl_lab train); pick one of the single-exit ones here.")
        if not (isinstance(lam, (int, float)) and math.isfinite(lam) and lam >= 0):
            raise bad_value("lam", lam, "a finite number >= 0", "use e.g. lam=0.1")
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise bad_value("temperature", temperature, "a finite number > 0", "use e.g. temperature=0.1")
        if anchors not in ANCHORS:
            raise bad_value("anchors", anchors, ANCHORS, "use 'all' (the paper's default reading) or 'samples'")
        if not (isinstance(threshold, (int, float)) and 0.0 <= threshold <= 180.0):
            raise bad_value("threshold", threshold, "degrees in [0, 180]", "use 90 (the paper's default)")
        if scope not in SCOPES:
            raise bad_value("scope", scope, SCOPES, "use 'all' (the paper's exact definition)")
        if scope == "head" and objective == "ce+scl":
            raise bad_value("scope", scope, "'all' or 'repr' with ce+scl",
                            "SCL does not use the classifier layer, so its gradient there is zero and the angle "
                            "always 90 degrees; use scope='all' (exact) or 'repr'")
        if acl_grad and objective == "ce":
            raise bad_value("acl_grad", acl_grad, "True only with a contrastive objective",
                            "drop acl_grad or pick 'ce+scl', 'acl-embed' or 'acl'")
        super().__init__(*args, **kwargs)
        self.objective = objective
        self.lam = float(lam)
        self.temperature = float(temperature)
        self.anchors = anchors
        self.threshold = float(threshold)
        self.scope = scope
        self.gated = objective != "ce" and (objective == "acl" if acl_grad is None else bool(acl_grad))
        self.classifier_name = classifier
        self.gate_history: list[dict[str, Any]] = []
        self._attached: nn.Module | None = None
        self._layer: nn.Linear | None = None
        self._hook = None
        self._capturing = False
        self._captured: tuple[Tensor, Tensor] | None = None
        self._checked = False
        self._gate: ACLGrad | None = None
        self._reset_parts()
        if self.model is not None and objective != "ce":
            self._attach(self.model)

    # ---- the classifier layer and its hook ---------------------------------
    def _attach(self, model: nn.Module) -> None:
        """Find the classifier layer of ``model`` (the rule) and hook it to capture its input and output."""
        if self._hook is not None:
            self._hook.remove()
        name, layer = find_classifier(model, self.classifier_name)
        self.classifier_name, self._layer, self._attached = name, layer, model
        self._hook = layer.register_forward_hook(self._capture)
        self._checked, self._gate = False, None

    def _capture(self, module: nn.Module, args: tuple, output: Tensor) -> None:
        if self._capturing:
            self._captured = (args[0], output)

    def _representation(self, outputs: Any, labels: Tensor) -> Tensor:
        """The captured input of the classifier layer; on the first batch, check the rule's assumptions."""
        if self._captured is None:
            raise AclLabError(
                f"The classifier layer {self.classifier_name!r} did not run in the training forward pass. "
                "Fix: pass classifier='<dotted name of the nn.Linear that outputs the logits>'."
            )
        rep, out = self._captured
        self._captured = None
        if not self._checked:
            logits = outputs.get("logits") if hasattr(outputs, "get") else None
            if logits is None or out.shape != logits.shape or not torch.equal(out.detach(), logits.detach()):
                raise AclLabError(
                    f"The output of {self.classifier_name!r} ({tuple(out.shape)}) is not the model's logits "
                    f"({None if logits is None else tuple(logits.shape)}), so its weight rows are not the label "
                    f"embeddings of PAPER.md. The rule is {RULE}. Fix: pass classifier='<dotted name of the "
                    "nn.Linear whose output is the logits>'."
                )
            if rep.dim() != 2 or rep.shape[0] != labels.shape[0]:
                raise AclLabError(
                    f"The input of {self.classifier_name!r} has shape {tuple(rep.shape)}, not [batch={labels.shape[0]}, "
                    "d]: it is not one representation per sample. Fix: pass classifier='<the nn.Linear applied to "
                    "the pooled [batch, d] representation>'."
                )
            if labels.dim() != 1 or labels.is_floating_point():
                raise AclLabError(
                    f"Contrastive objectives need one integer class label per sample; got labels of dtype "
                    f"{labels.dtype} and shape {tuple(labels.shape)} (regression or multi-label). Fix: use "
                    "objective='ce' for this task."
                )
            num_classes = self._layer.out_features
            if int(labels.min()) < 0 or int(labels.max()) >= num_classes:
                raise AclLabError(
                    f"Labels must lie in [0, {num_classes}) for the {num_classes} label embeddings; got "
                    f"[{int(labels.min())}, {int(labels.max())}]. Fix: map the labels to 0..{num_classes - 1}."
                )
            self._checked = True
        return rep

    # ---- the objective ------------------------------------------------------
    def _aux_loss(self, rep: Tensor, labels: Tensor) -> Tensor:
        """lam * SCL or lam * ACL-Embed over the global batch (gathered with gradient under DDP)."""
        feats, labs = gather_with_grad(rep.float()), gather_with_grad(labels)
        if self.objective == "ce+scl":
            term = supcon_loss(feats, labs, temperature=self.temperature)
        else:
            term = acl_embed_loss(feats, labs, self._layer.weight.float(), temperature=self.temperature,
                                  anchors=self.anchors)
        return self.lam * term

    def _backward_scale(self) -> Callable[[Tensor], Tensor]:
        """What ``accelerator.backward`` does to a loss before ``.backward()`` (its accumulation, the fp16 scaler)."""
        from accelerate.utils import DistributedType

        acc = self.accelerator
        if acc.distributed_type in (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM,
                                    DistributedType.XLA) or getattr(acc, "has_lomo_optimizer", False):
            raise AclLabError(
                f"The ACL-Grad gate takes two gradients per batch, which {acc.distributed_type} (or a LOMO optimizer) "
                "does not allow. Fix: train with DDP (torchrun / accelerate launch without DeepSpeed or FSDP), or "
                "switch the gate off (acl_grad=False, or objective='acl-embed')."
            )
        steps, scaler = acc.gradient_accumulation_steps, acc.scaler

        def scale(loss: Tensor) -> Tensor:
            loss = loss / steps
            return scaler.scale(loss) if scaler is not None else loss

        return scale

    def _make_gate(self) -> ACLGrad:
        params = [p for p in self._attached.parameters() if p.requires_grad]
        reduce = all_reduce_mean if is_distributed() else None  # decide on the global gradients under DDP
        if self.scope == "head":
            return ACLGrad(params, lam=1.0, threshold=self.threshold, scope="params",
                           scope_params=list(self._layer.parameters()), reduce=reduce)
        return ACLGrad(params, lam=1.0, threshold=self.threshold, scope=self.scope, reduce=reduce)

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Tensor | int | None = None) -> Tensor:
        """One micro-batch: forward, CE and aux, then ``g_CE + lam_t g_aux`` (or the ungated sum) into ``.grad``.

        Each part is the micro-batch mean divided by the number of micro-batches of the step, so with
        gradient accumulation the update is the mean over micro-batches, for every objective alike
        (``num_items_in_batch`` is not used: several sequence classifiers, BERT's among them, accept it but
        ignore it, and the plain Trainer then sums their per-micro-batch means instead).
        """
        contrastive = self.objective != "ce"
        if contrastive and self.args.n_gpu > 1:
            raise AclLabError(
                f"Contrastive objectives do not run under torch.nn.DataParallel ({self.args.n_gpu} GPUs in one "
                "process). Fix: launch one process per GPU with torchrun or accelerate launch (DDP)."
            )
        if contrastive and self._attached is not self.model:  # model_init, or a model swapped after __init__
            self._attach(self.model)
        scale = self._backward_scale() if self.gated else None
        cp_context, inputs = self._prepare_context_parallel_inputs(model, inputs)
        with cp_context():
            model.train()
            if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
                self.optimizer.train()
            inputs = self._prepare_inputs(inputs)
            labels = inputs.get("labels")
            if labels is None and contrastive:
                raise AclLabError("The training batch has no 'labels'. Fix: give the dataset a 'labels' (or 'label') "
                                  "column of class ids.")
            # The gate (ACLGrad with reduce=) averages the gradients itself, so DDP's reducer must not expect this
            # backward: its hooks are armed by the forward pass, hence no_sync() around forward AND backward.
            gated_ddp = self.gated and is_distributed()
            with self.accelerator.no_sync(model) if gated_ddp else contextlib.nullcontext():
                self._capturing = contrastive
                try:
                    with self.compute_loss_context_manager():
                        # num_items_in_batch=None: every part is a per-micro-batch mean, divided by the number of
                        # micro-batches below, so the step is the mean over the accumulated batch (see the docstring)
                        ce, outputs = self.compute_loss(model, inputs, return_outputs=True, num_items_in_batch=None)
                finally:
                    self._capturing = False
                steps = self.current_gradient_accumulation_steps
                ce = ce / steps
                rep = self._representation(outputs, labels) if contrastive else None
                aux = self._aux_loss(rep, labels) / steps if contrastive else None
                del inputs, outputs
                if self.gated:
                    if self._gate is None:
                        self._gate = self._make_gate()
                    rec = self._gate.backward(ce, aux, scale=scale,
                                              scope_tensors=[rep] if self.scope == "repr" else None)
                    self.gate_history.append({"step": self.state.global_step + 1, "cos": rec.cos,
                                              "angle": rec.angle, "kept": bool(rec.kept)})
                    self._gate_since_log.append(rec)
                else:
                    from accelerate.utils import DistributedType

                    kwargs = {"scale_wrt_gas": False} if self.accelerator.distributed_type == DistributedType.DEEPSPEED \
                        else {}
                    self.accelerator.backward(ce + aux if contrastive else ce, **kwargs)
            self._add_parts(ce, aux)
            return (ce + aux if contrastive else ce).detach()

    # ---- logging ------------------------------------------------------------
    def _reset_parts(self) -> None:
        self._ce_sum: Tensor | None = None
        self._aux_sum: Tensor | None = None
        self._gate_since_log: list = []
        self._parts_steps: set[int] = set()  # optimizer steps (global_step while accumulating) since the last log

    def _add_parts(self, ce: Tensor, aux: Tensor | None) -> None:
        self._parts_steps.add(self.state.global_step)
        ce = ce.detach().float()
        self._ce_sum = ce if self._ce_sum is None else self._ce_sum + ce
        if aux is not None:
            aux = aux.detach().float()
            self._aux_sum = aux if self._aux_sum is None else self._aux_sum + aux

    def _pop_parts(self) -> dict[str, float]:
        """``ce``, ``aux``, ``cos``, ``angle``, ``kept`` since the last log (per optimizer step, like ``loss``)."""
        steps = max(1, len(self._parts_steps))
        sums = torch.stack([self._ce_sum] + ([self._aux_sum] if self._aux_sum is not None else []))
        sums = all_reduce_mean(sums)  # ce is per rank; aux is already the global-batch value on every rank
        parts = {"ce": float(sums[0]) / steps}
        if self._aux_sum is not None:
            parts["aux"] = float(sums[1]) / steps
        recs = self._gate_since_log
        if recs:
            finite = [r for r in recs if math.isfinite(r.cos)]
            parts["cos"] = sum(r.cos for r in finite) / len(finite) if finite else math.nan
            parts["angle"] = sum(r.angle for r in finite) / len(finite) if finite else math.nan
            parts["kept"] = sum(bool(r.kept) for r in recs) / len(recs)
        self._reset_parts()
        return parts

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's ``log``, with the loss parts added to each training log (so they reach ``report_to``)."""
        if "loss" in logs and self._ce_sum is not None:
            logs = {**logs, **self._pop_parts()}
        super().log(logs, start_time)

    def drop_rate(self) -> float | None:
        """Share of gated micro-batches whose aux term was dropped; ``None`` without the gate or before training."""
        if not self.gate_history:
            return None
        return 1.0 - sum(r["kept"] for r in self.gate_history) / len(self.gate_history)


def sequence_classifier(name: str, num_labels: int, seed: int = 0, dropout: float | None = None):
    """``(model, tokenizer)``: an ``AutoModelForSequenceClassification`` for the kit's model names.

    ``"minilm-l6"`` is the offline pretrained MiniLM-L6 (:func:`acl_lab.assets.model_dir`) with a fresh
    classifier; ``"tiny"`` the 4-layer random BERT of width 32 (:data:`acl_lab.model.TINY_CONFIG`) with the
    MiniLM tokenizer, for tests and the smoke preset; anything else a local folder or a hub id.
    ``dropout`` (when given) sets the BERT-family config's hidden, attention and classifier dropout.
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertConfig, \
        BertForSequenceClassification

    from .assets import model_dir
    from .model import OFFLINE_DEFAULT, TINY, TINY_CONFIG, _quiet_transformers

    source = str(model_dir(OFFLINE_DEFAULT)) if name in (TINY, OFFLINE_DEFAULT) else name
    drop = {} if dropout is None else dict(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
                                           classifier_dropout=dropout)
    try:
        with _quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(source)
            with torch.random.fork_rng():
                torch.manual_seed(seed)  # the fresh classifier (or the whole tiny model) from the seed
                if name == TINY:
                    config = BertConfig(vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.pad_token_id,
                                        num_labels=num_labels, **TINY_CONFIG, **drop)
                    model = BertForSequenceClassification(config)
                else:
                    model = AutoModelForSequenceClassification.from_pretrained(source, num_labels=num_labels, **drop)
    except OSError as exc:
        raise AclLabError(
            f"Could not load model {name!r} ({str(exc).splitlines()[0][:200]}). Fix: use 'minilm-l6' (offline), "
            "'tiny', a local Hugging Face folder, or a hub id with internet access."
        ) from None
    return model, tokenizer
