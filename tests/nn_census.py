"""The torch.nn census: small models built only from torch.nn's building blocks, one or more per family.

`CENSUS` maps a row name to an `Entry`: its family, a builder `() -> (model, inputs)` and a note. Every model is
a `Net` (or a module of its own written with torch.nn only) whose forward returns the loss; `inputs` is a tuple of
positional tensors with batch 4 (divisible by 2 and 4). Builders seed torch (0) and draw inputs from their own
generator, in fp64 (the default dtype is set to float64 while building), so the same call gives the same model
and batch. Shapes are tiny but the activations outweigh the parameters (several tokens, pixels or time steps per
sample), so a batch-parallel program does measurably half the work on each of 2 ranks.

Rows where a module is not deterministic in training are built in eval mode, and the note says so: the dropout
modules (a random mask cannot be compared to one device), RReLU (random slopes in training), BatchNorm in the
ResNet (in training it mixes the batch: its statistics are a batch mean).

Running a row (shared by `tests/test_nn_census.py` and `benchmarks/nn_census.py`): `reference(name, world)` runs
the model on one device (loss, gradients, parameters after an SGD step, `FlopCount` of forward + backward) and
autopar's program for it on a 1-rank mesh (its FLOPs); `run_plan(name, plan, ref, world)` parallelises a fresh
build on 2 simulated ranks and compares one step; `flop_problem` and `gathered` say what is not data parallel.

Three models are also the side-by-side benchmarks' (`benchmarks/dp_vs_ddp.py`, `benchmarks/fsdp_vs_fsdp2.py`),
with sizes as arguments: `RMSNormLlama` (torch's `nn.RMSNorm` and `F.scaled_dot_product_attention`, issue #22's
model), `ConvNet` (Conv2d + GroupNorm image classifier) and `LSTMLM` (an `nn.LSTM` language model).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

BATCH = 4


@dataclass(frozen=True)
class Entry:
    family: str
    build: Callable[[], tuple[nn.Module, tuple]]
    note: str = ""


class Net(nn.Module):
    """`loss(body(x), y)`: a torch.nn body and a torch.nn loss module."""

    def __init__(self, body: nn.Module, loss: nn.Module):
        super().__init__()
        self.body = body
        self.loss = loss

    def forward(self, x, y):
        return self.loss(self.body(x), y)


@contextlib.contextmanager
def _fp64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _randn(g, *shape):
    return torch.randn(*shape, generator=g)  # the default dtype: fp64 inside `_built`


def _built(make: Callable, *, eval_mode: bool = False):
    """A builder: seeds torch, builds `make(g)` -> (model, inputs) in fp64, eval mode if asked."""
    def build():
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        with _fp64():
            model, inputs = make(g)
        model.train(not eval_mode)
        for name, p in model.named_parameters():
            assert p.dtype == torch.float64, f"{name} is {p.dtype}"
        return model, inputs
    return build


# ----------------------------------------------------------------------------- shapes shared by the small rows

D, SEQ = 16, 8  # features, tokens per sample: x is (BATCH, SEQ, D)
C, HW = 4, 8  # image channels, side: x is (BATCH, C, HW, HW)


def _tokens_regression(body, g, d_out=D):
    return Net(body, nn.MSELoss()), (_randn(g, BATCH, SEQ, D), _randn(g, BATCH, SEQ, d_out))


def _image_regression(body, g, c_out=C, hw_out=HW):
    return Net(body, nn.MSELoss()), (_randn(g, BATCH, C, HW, HW), _randn(g, BATCH, c_out, hw_out, hw_out))


def _mlp_around(*mods: nn.Module, d_in=D, d_mid=2 * D) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, d_mid), *mods, nn.Linear(d_mid, D))


def _conv_around(*mods: nn.Module, c_mid=8) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(C, c_mid, 3, padding=1), *mods, nn.Conv2d(c_mid, C, 3, padding=1))


# ----------------------------------------------------------------------------- norms

def layer_norm(g):
    return _tokens_regression(_mlp_around(nn.LayerNorm(2 * D)), g)


def rms_norm(g):
    return _tokens_regression(_mlp_around(nn.RMSNorm(2 * D)), g)


def group_norm(g):
    return _image_regression(_conv_around(nn.GroupNorm(4, 8), nn.SiLU()), g)


def instance_norm1d(g):
    body = nn.Sequential(nn.Conv1d(C, 8, 3, padding=1), nn.InstanceNorm1d(8, affine=True), nn.ReLU(),
                         nn.Conv1d(8, C, 3, padding=1))
    return Net(body, nn.MSELoss()), (_randn(g, BATCH, C, 32), _randn(g, BATCH, C, 32))


def instance_norm2d(g):
    return _image_regression(_conv_around(nn.InstanceNorm2d(8, affine=True), nn.ReLU()), g)


def local_response_norm(g):
    return _image_regression(_conv_around(nn.LocalResponseNorm(3), nn.ReLU()), g)


# ----------------------------------------------------------------------------- activations
# x is (BATCH, 2, SEQ, D): 4-D so that Softmax2d (over dim -3) normalises features, not the batch.

def _activations(acts: Callable[[], tuple[nn.Module, ...]]):
    def make(g):
        mods: list[nn.Module] = [nn.Linear(D, D)]
        for a in acts():
            mods += [a, nn.Linear(D // 2 if isinstance(a, nn.GLU) else D, D)]
        return Net(nn.Sequential(*mods), nn.MSELoss()), (_randn(g, BATCH, 2, SEQ, D), _randn(g, BATCH, 2, SEQ, D))
    return make


ACTIVATIONS = {  # made when a row is built (PReLU's weight in the dtype of that moment)
    "activations_relu": lambda: (nn.ReLU(), nn.ReLU6(), nn.LeakyReLU(0.1), nn.PReLU(), nn.RReLU(), nn.ELU(), nn.CELU(0.5),
                         nn.SELU(), nn.Threshold(0.1, -1.0)),
    "activations_smooth": lambda: (nn.GELU(), nn.GELU(approximate="tanh"), nn.SiLU(), nn.Mish(), nn.Softplus(beta=2.0),
                           nn.Softsign(), nn.Sigmoid(), nn.Tanh(), nn.LogSigmoid(), nn.Tanhshrink()),
    "activations_hard": lambda: (nn.Hardtanh(-0.5, 0.5), nn.Hardswish(), nn.Hardsigmoid(), nn.Hardshrink(0.1),
                         nn.Softshrink(0.1)),
    "activations_softmax": lambda: (nn.Softmax(dim=-1), nn.LogSoftmax(dim=-1), nn.Softmin(dim=-1), nn.Softmax2d(), nn.GLU()),
}


# ----------------------------------------------------------------------------- convolutions, pooling, resampling

def conv1d(g):
    body = nn.Sequential(nn.Conv1d(C, 8, 5, padding=2), nn.ReLU(), nn.Conv1d(8, 8, 3, stride=2, dilation=2, padding=2),
                         nn.ReLU(), nn.Conv1d(8, C, 1))
    return Net(body, nn.MSELoss()), (_randn(g, BATCH, C, 32), _randn(g, BATCH, C, 16))


def conv2d(g):
    body = nn.Sequential(nn.Conv2d(C, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, groups=2), nn.ReLU(),
                         nn.Conv2d(8, C, 1, bias=False))
    return _image_regression(body, g)


def conv3d(g):
    body = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv3d(4, 2, 3, padding=1))
    return Net(body, nn.MSELoss()), (_randn(g, BATCH, 2, 4, 6, 6), _randn(g, BATCH, 2, 4, 6, 6))


def conv_transpose2d(g):
    body = nn.Sequential(nn.Conv2d(C, 8, 3, stride=2, padding=1), nn.ReLU(),
                         nn.ConvTranspose2d(8, C, 4, stride=2, padding=1))
    return _image_regression(body, g)


def pooling1d(g):
    body = nn.Sequential(nn.Conv1d(C, 8, 3, padding=1), nn.MaxPool1d(2), nn.Conv1d(8, 8, 3, padding=1),
                         nn.AvgPool1d(2), nn.AdaptiveMaxPool1d(6), nn.AdaptiveAvgPool1d(4), nn.Flatten(),
                         nn.Linear(32, 10))
    return Net(body, nn.CrossEntropyLoss()), (_randn(g, BATCH, C, 32), torch.randint(0, 10, (BATCH,), generator=g))


def pooling2d(g):
    body = nn.Sequential(nn.Conv2d(C, 8, 3, padding=1), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1),
                         nn.AvgPool2d(2, ceil_mode=True), nn.AdaptiveMaxPool2d(3), nn.AdaptiveAvgPool2d(2),
                         nn.Flatten(), nn.Linear(32, 10))
    return Net(body, nn.CrossEntropyLoss()), (_randn(g, BATCH, C, 16, 16),
                                              torch.randint(0, 10, (BATCH,), generator=g))


def upsample(g):
    body = nn.Sequential(nn.Conv2d(C, 8, 3, padding=1), nn.Upsample(scale_factor=2, mode="nearest"),
                         nn.Conv2d(8, 8, 3, padding=1), nn.Upsample(size=(20, 20), mode="bilinear"),
                         nn.Conv2d(8, C, 3, padding=1))
    return _image_regression(body, g, hw_out=20)


def pixel_shuffle(g):
    body = nn.Sequential(nn.Conv2d(C, 16, 3, padding=1), nn.PixelShuffle(2), nn.Conv2d(4, 8, 3, padding=1),
                         nn.PixelUnshuffle(2), nn.Conv2d(32, C, 1))
    return _image_regression(body, g)


# ----------------------------------------------------------------------------- embeddings

VOCAB = 64


def embedding(g):
    body = nn.Sequential(nn.Embedding(VOCAB, D, padding_idx=0), nn.Linear(D, 2 * D), nn.GELU(),
                         nn.Linear(2 * D, VOCAB))

    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = body
            self.loss = nn.CrossEntropyLoss()

        def forward(self, ids, labels):
            return self.loss(self.body(ids).flatten(0, 1), labels.flatten())

    ids = torch.randint(0, VOCAB, (BATCH, 16), generator=g)
    return Tokens(), (ids, torch.randint(0, VOCAB, (BATCH, 16), generator=g))


def embedding_bag(g):
    class Bags(nn.Module):
        def __init__(self):
            super().__init__()
            self.mean_bag = nn.EmbeddingBag(VOCAB, D, mode="mean")
            self.sum_bag = nn.EmbeddingBag(VOCAB, D, mode="sum")
            self.head = nn.Sequential(nn.Linear(2 * D, 2 * D), nn.ReLU(), nn.Linear(2 * D, 10))
            self.loss = nn.CrossEntropyLoss()

        def forward(self, ids, labels):
            return self.loss(self.head(torch.cat([self.mean_bag(ids), self.sum_bag(ids)], dim=-1)), labels)

    return Bags(), (torch.randint(0, VOCAB, (BATCH, 24), generator=g), torch.randint(0, 10, (BATCH,), generator=g))


# ----------------------------------------------------------------------------- attention and transformers

class SeqRegression(nn.Module):
    """`mse(proj(core(x)), y)`: the core takes and returns (batch, seq, D)."""

    def __init__(self, core: nn.Module):
        super().__init__()
        self.core = core
        self.proj = nn.Linear(D, D)
        self.loss = nn.MSELoss()

    def forward(self, x, y):
        return self.loss(self.proj(self.core(x)), y)


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 4, batch_first=True)

    def forward(self, x):
        out, _ = self.attn(x, x, x, need_weights=False)
        return out


def multihead_attention(g):
    return SeqRegression(SelfAttention()), (_randn(g, BATCH, SEQ, D), _randn(g, BATCH, SEQ, D))


def transformer_encoder(g):
    layer = nn.TransformerEncoderLayer(D, 4, dim_feedforward=2 * D, dropout=0.0, batch_first=True)
    core = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    return SeqRegression(core), (_randn(g, BATCH, SEQ, D), _randn(g, BATCH, SEQ, D))


class DecoderOnMemory(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerDecoderLayer(D, 4, dim_feedforward=2 * D, dropout=0.0, batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(layer, num_layers=2)
        self.loss = nn.MSELoss()

    def forward(self, tgt, memory, y):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], dtype=tgt.dtype)
        return self.loss(self.decoder(tgt, memory, tgt_mask=mask, tgt_is_causal=True), y)


def transformer_decoder(g):
    return DecoderOnMemory(), (_randn(g, BATCH, SEQ, D), _randn(g, BATCH, 6, D), _randn(g, BATCH, SEQ, D))


class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.t = nn.Transformer(D, 4, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=2 * D, dropout=0.0,
                                batch_first=True)
        self.loss = nn.MSELoss()

    def forward(self, src, tgt, y):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], dtype=tgt.dtype)
        return self.loss(self.t(src, tgt, tgt_mask=mask, tgt_is_causal=True), y)


def transformer(g):
    return Seq2Seq(), (_randn(g, BATCH, 6, D), _randn(g, BATCH, SEQ, D), _randn(g, BATCH, SEQ, D))


# ----------------------------------------------------------------------------- recurrent

class Recurrent(nn.Module):
    def __init__(self, rnn: nn.Module):
        super().__init__()
        self.rnn = rnn
        self.proj = nn.Linear(D, D)
        self.loss = nn.MSELoss()

    def forward(self, x, y):
        out, _ = self.rnn(x)
        return self.loss(self.proj(out), y)


def _recurrent(rnn_cls, **kw):
    def make(g):
        return Recurrent(rnn_cls(D, D, batch_first=True, **kw)), (_randn(g, BATCH, SEQ, D), _randn(g, BATCH, SEQ, D))
    return make


class LSTMLM(nn.Module):
    """An `nn.LSTM` language model: embedding, LSTM, linear head, cross-entropy over every position."""

    def __init__(self, vocab: int = VOCAB, dim: int = D, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, num_layers=layers, batch_first=True)
        self.head = nn.Linear(dim, vocab)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, ids, labels):
        out, _ = self.lstm(self.embed(ids))
        return self.loss(self.head(out).flatten(0, 1), labels.flatten())


def lstm_lm(g, vocab=VOCAB, dim=D, layers=2, batch=BATCH, seq=SEQ):
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return LSTMLM(vocab, dim, layers), (ids, torch.roll(ids, -1, dims=1))


# ----------------------------------------------------------------------------- dropout, flatten

class Dropouts(nn.Module):
    """Every dropout module between two convolutions (each on an input of the rank it takes)."""

    def __init__(self):
        super().__init__()
        self.conv_in, self.conv_out = nn.Conv2d(C, 8, 3, padding=1), nn.Conv2d(8, C, 3, padding=1)
        self.drop, self.drop2d, self.alpha, self.feature_alpha = (nn.Dropout(0.5), nn.Dropout2d(0.5),
                                                                  nn.AlphaDropout(0.5), nn.FeatureAlphaDropout(0.5))
        self.drop1d, self.drop3d = nn.Dropout1d(0.5), nn.Dropout3d(0.5)
        self.loss = nn.MSELoss()

    def forward(self, x, y):
        h = self.feature_alpha(self.alpha(self.drop2d(self.drop(self.conv_in(x)))))
        h = self.drop1d(h.flatten(2)).unflatten(2, x.shape[2:])
        h = self.drop3d(h.unsqueeze(2)).squeeze(2)
        return self.loss(self.conv_out(h), y)


def dropout(g):
    return Dropouts(), (_randn(g, BATCH, C, HW, HW), _randn(g, BATCH, C, HW, HW))


def flatten(g):
    body = nn.Sequential(nn.Conv2d(C, 4, 3, padding=1), nn.Flatten(), nn.Linear(4 * HW * HW, 64), nn.ReLU(),
                         nn.Unflatten(1, (4, 4, 4)), nn.Conv2d(4, C, 3, padding=1), nn.Flatten(start_dim=2),
                         nn.Unflatten(2, (4, 4)))
    return Net(body, nn.MSELoss()), (_randn(g, BATCH, C, HW, HW), _randn(g, BATCH, C, 4, 4))


# ----------------------------------------------------------------------------- losses

class Losses(nn.Module):
    """A linear head `(BATCH, SEQ, D) -> (BATCH, SEQ, K)` and the sum of the given losses of its output."""

    def __init__(self, k: int, losses: dict[str, nn.Module], prepare: Callable):
        super().__init__()
        self.head = nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, k))
        self.losses = nn.ModuleDict(losses)
        self.prepare = prepare

    def forward(self, x, target):
        out = self.head(x)
        return sum(fn(*self.prepare(name, out, target)) for name, fn in self.losses.items())


def _classes(name, out, target):
    if name == "nll":
        return F.log_softmax(out, dim=-1).flatten(0, 1), target.flatten()
    return out.flatten(0, 1), target.flatten()


def loss_classification(g):
    k = 6
    losses = {"cross_entropy": nn.CrossEntropyLoss(weight=torch.linspace(0.5, 2.0, k), label_smoothing=0.1),
              "cross_entropy_ignore": nn.CrossEntropyLoss(ignore_index=0),
              "nll": nn.NLLLoss(weight=torch.linspace(2.0, 0.5, k))}
    target = torch.randint(0, k, (BATCH, SEQ), generator=g)
    return Losses(k, losses, _classes), (_randn(g, BATCH, SEQ, D), target)


def loss_regression(g):
    losses = {"mse": nn.MSELoss(), "l1": nn.L1Loss(), "smooth_l1": nn.SmoothL1Loss(beta=0.5),
              "huber": nn.HuberLoss(delta=0.5), "mse_sum": nn.MSELoss(reduction="sum")}
    return Losses(4, losses, lambda name, out, t: (out, t)), (_randn(g, BATCH, SEQ, D), _randn(g, BATCH, SEQ, 4))


def _probabilities(name, out, target):
    if name == "kl_div":
        return F.log_softmax(out, dim=-1), F.softmax(target, dim=-1)
    return out, (target > 0).to(out.dtype)


def loss_probabilistic(g):
    losses = {"bce_with_logits": nn.BCEWithLogitsLoss(pos_weight=torch.linspace(0.5, 2.0, 4)),
              "kl_div": nn.KLDivLoss(reduction="batchmean")}
    return Losses(4, losses, _probabilities), (_randn(g, BATCH, SEQ, D), _randn(g, BATCH, SEQ, 4))


class PairEmbedding(nn.Module):
    """Two inputs through one encoder; CosineEmbeddingLoss on their embeddings, targets +1 / -1 per pair."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(D, 2 * D), nn.ReLU(), nn.Linear(2 * D, D), nn.Flatten())
        self.loss = nn.CosineEmbeddingLoss(margin=0.1)

    def forward(self, a, b, target):
        return self.loss(self.encoder(a), self.encoder(b), target)


def loss_cosine_embedding(g):
    target = torch.tensor([1.0, -1.0, 1.0, -1.0])
    return PairEmbedding(), (_randn(g, BATCH, SEQ, D), _randn(g, BATCH, SEQ, D), target)


class CTCModel(nn.Module):
    """A frame classifier trained with CTC: (batch, time, D) -> log-probabilities (time, batch, classes)."""

    def __init__(self, classes: int = 6):
        super().__init__()
        self.frames = nn.Sequential(nn.Linear(D, 2 * D), nn.ReLU(), nn.Linear(2 * D, classes), nn.LogSoftmax(-1))
        self.loss = nn.CTCLoss(blank=0)

    def forward(self, x, targets, input_lengths, target_lengths):
        return self.loss(self.frames(x).transpose(0, 1), targets, input_lengths, target_lengths)


def loss_ctc(g):
    t = 12
    targets = torch.randint(1, 6, (BATCH, 4), generator=g)
    return CTCModel(), (_randn(g, BATCH, t, D), targets, torch.tensor([12, 10, 12, 9]), torch.tensor([4, 3, 2, 4]))


# ----------------------------------------------------------------------------- whole networks

class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU()
        self.down = None if stride == 1 and c_in == c_out else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x):
        skip = x if self.down is None else self.down(x)
        return self.relu(self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))) + skip)


def resnet(g):
    body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         BasicBlock(8, 8, 1), BasicBlock(8, 16, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(16, 10))
    model = Net(body, nn.CrossEntropyLoss())
    with torch.no_grad():  # running statistics that are not the defaults (0, 1): eval mode uses them
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5, generator=g)
                m.running_var.uniform_(0.5, 1.5, generator=g)
    return model, (_randn(g, BATCH, 3, 16, 16), torch.randint(0, 10, (BATCH,), generator=g))


class ViT(nn.Module):
    """Patch convolution, [CLS] token, learned positions, pre-norm TransformerEncoder, linear head on [CLS]."""

    def __init__(self, image: int = 16, patch: int = 4, dim: int = D, layers: int = 2, classes: int = 10):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, 4, dim_feedforward=2 * dim, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(dim), enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, images, labels):
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.loss(self.head(self.encoder(x)[:, 0]), labels)


def vit(g):
    return ViT(), (_randn(g, BATCH, 3, 16, 16), torch.randint(0, 10, (BATCH,), generator=g))


def _conv_gn(c_in, c_out):
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(2, c_out), nn.SiLU())


class UNet(nn.Module):
    """Two levels: conv blocks, max-pool down, transposed-conv up, skip connections by concatenation."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.down1, self.down2 = _conv_gn(C, c), _conv_gn(c, 2 * c)
        self.pool = nn.MaxPool2d(2)
        self.mid = _conv_gn(2 * c, 2 * c)
        self.up2 = nn.ConvTranspose2d(2 * c, 2 * c, 2, stride=2)
        self.dec2 = _conv_gn(4 * c, c)
        self.up1 = nn.ConvTranspose2d(c, c, 2, stride=2)
        self.dec1 = _conv_gn(2 * c, c)
        self.out = nn.Conv2d(c, C, 1)
        self.loss = nn.MSELoss()

    def forward(self, x, y):
        d1 = self.down1(x)
        d2 = self.down2(self.pool(d1))
        m = self.mid(self.pool(d2))
        u2 = self.dec2(torch.cat([self.up2(m), d2], dim=1))
        u1 = self.dec1(torch.cat([self.up1(u2), d1], dim=1))
        return self.loss(self.out(u1), y)


def unet(g):
    return UNet(), (_randn(g, BATCH, C, 16, 16), _randn(g, BATCH, C, 16, 16))


# ----------------------------------------------------------------------------- the benchmarks' models

class RMSNormBlock(nn.Module):
    """A Llama block from torch's own modules: nn.RMSNorm, F.scaled_dot_product_attention (causal), SwiGLU MLP."""

    def __init__(self, dim: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim)
        self.gate = nn.Linear(dim, ffn, bias=False)
        self.up = nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class RMSNormLlama(nn.Module):
    """Issue #22's model: embedding, `layers` RMSNormBlocks, nn.RMSNorm, untied head, cross-entropy."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, layers: int = 2, heads: int = 4, ffn: int | None = None):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(RMSNormBlock(dim, heads, ffn or 3 * dim) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids, labels):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), labels.flatten())


def rmsnorm_llama(g, vocab=VOCAB, dim=32, layers=2, heads=4, batch=BATCH, seq=16):
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return RMSNormLlama(vocab, dim, layers, heads), (ids, torch.roll(ids, -1, dims=1))


class ConvNet(nn.Module):
    """An image classifier: stages of Conv2d + GroupNorm + ReLU (all but the first strided), global average pool,
    linear head, cross-entropy."""

    def __init__(self, channels: tuple[int, ...] = (8, 16), classes: int = 10, groups: int = 4):
        super().__init__()
        c_in, stages = 3, []
        for i, c in enumerate(channels):
            stages.append(nn.Sequential(nn.Conv2d(c_in, c, 3, stride=1 if i == 0 else 2, padding=1),
                                        nn.GroupNorm(groups, c), nn.ReLU()))
            c_in = c
        self.stages = nn.ModuleList(stages)
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(c_in, classes)
        self.loss = nn.CrossEntropyLoss()

    def forward(self, images, labels):
        x = images
        for stage in self.stages:
            x = stage(x)
        return self.loss(self.head(self.pool(x)), labels)


def convnet(g, channels=(8, 16), image=16, batch=BATCH, classes=10):
    return ConvNet(channels, classes), (_randn(g, batch, 3, image, image),
                                        torch.randint(0, classes, (batch,), generator=g))


# ----------------------------------------------------------------------------- the registry

_EVAL_DROPOUT = "eval mode: dropout is the identity (a random mask cannot be compared to one device)"
CENSUS: dict[str, Entry] = {
    "layer_norm": Entry("norm", _built(layer_norm)),
    "rms_norm": Entry("norm", _built(rms_norm)),
    "group_norm": Entry("norm", _built(group_norm)),
    "instance_norm1d": Entry("norm", _built(instance_norm1d)),
    "instance_norm2d": Entry("norm", _built(instance_norm2d)),
    "local_response_norm": Entry("norm", _built(local_response_norm)),
    **{name: Entry("activation", _built(_activations(acts), eval_mode=name == "activations_relu"),
                   "eval mode (RReLU's slope is random in training)" if name == "activations_relu" else "")
       for name, acts in ACTIVATIONS.items()},
    "conv1d": Entry("conv", _built(conv1d)),
    "conv2d": Entry("conv", _built(conv2d)),
    "conv3d": Entry("conv", _built(conv3d)),
    "conv_transpose2d": Entry("conv", _built(conv_transpose2d)),
    "pooling1d": Entry("pooling", _built(pooling1d)),
    "pooling2d": Entry("pooling", _built(pooling2d)),
    "upsample": Entry("resampling", _built(upsample)),
    "pixel_shuffle": Entry("resampling", _built(pixel_shuffle)),
    "embedding": Entry("embedding", _built(embedding)),
    "embedding_bag": Entry("embedding", _built(embedding_bag)),
    "multihead_attention": Entry("attention", _built(multihead_attention)),
    "transformer_encoder": Entry("attention", _built(transformer_encoder)),
    "transformer_decoder": Entry("attention", _built(transformer_decoder)),
    "transformer": Entry("attention", _built(transformer),
                         "tgt_is_causal=True with its causal tgt_mask (without the hint nn.Transformer compares the "
                         "mask's values, a data-dependent branch)"),
    "rnn": Entry("recurrent", _built(_recurrent(nn.RNN, nonlinearity="tanh"))),
    "gru": Entry("recurrent", _built(_recurrent(nn.GRU, num_layers=2))),
    "lstm_lm": Entry("recurrent", _built(lstm_lm)),
    "dropout": Entry("dropout", _built(dropout, eval_mode=True), _EVAL_DROPOUT),
    "flatten": Entry("reshape", _built(flatten)),
    "loss_classification": Entry("loss", _built(loss_classification)),
    "loss_regression": Entry("loss", _built(loss_regression)),
    "loss_probabilistic": Entry("loss", _built(loss_probabilistic)),
    "loss_cosine_embedding": Entry("loss", _built(loss_cosine_embedding)),
    "loss_ctc": Entry("loss", _built(loss_ctc)),
    "resnet": Entry("network", _built(resnet, eval_mode=True),
                    "eval mode: BatchNorm uses its running statistics (in training it mixes the batch)"),
    "vit": Entry("network", _built(vit)),
    "unet": Entry("network", _built(unet)),
    "rmsnorm_llama": Entry("network", _built(rmsnorm_llama)),
    "convnet": Entry("network", _built(convnet)),
}


# ----------------------------------------------------------------------------- FLOPs with local shapes

def _grouped_mm_flops(a, b, *args, **kwargs) -> int:
    """aten._grouped_mm (torch's counter has no formula): 2D x 3D, 2D x 2D, 3D x 2D, 3D x 3D."""
    a, b = a.shape, b.shape
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    if len(a) == 2:
        return 2 * a[0] * a[1] * b[2]
    if len(b) == 2:
        return 2 * a[1] * a[2] * b[1]
    return 2 * a[0] * a[1] * a[2] * b[2]


def _numel(x) -> int:
    n = 1
    for s in x.shape:
        n *= int(s)
    return n


def _bag_gathers(args) -> int:
    """Elements an EmbeddingBag op gathers or scatters: its indices (the first integer tensor) x the embedding dim
    (the columns of its first floating matrix: the table in forward, the output's gradient in backward)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    indices = next(t for t in tensors if not t.is_floating_point())
    rows = next(t for t in tensors if t.is_floating_point() and t.dim() == 2)
    return _numel(indices) * int(rows.shape[1])


class FlopCount:
    """A TorchDispatchMode counting, per ATen op, the FLOPs of what runs under it with the shapes it sees (under
    LocalTensorMode entered first: one simulated rank's local shapes, ranks being alike):

    * `matmul`: torch's `FlopCounterMode` formulas (mm, addmm, bmm, baddbmm, convolution and its backward, the
      SDPA kernels), plus `aten._grouped_mm`, which torch's counter leaves at 0;
    * `other`: every other ATen op that computes (not a view, not a copy or concatenation, not a collective, not a
      factory of empty or constant tensors): one FLOP per element of its largest tensor, input or output (a
      pointwise op's output, a reduction's input, a norm's, an embedding's gather). Rough, but it sees a
      replicated norm, activation or pooling, which the matmul count alone would miss.

    An EmbeddingBag op (`aten._embedding_bag*`, forward or backward) counts one FLOP per element it gathers or
    scatters (indices x embedding dim), not its largest tensor: that is the table, of which it reads the indexed
    rows only.

    Ops outside `aten` (custom ops: FlopCounterMode cannot see inside them) are listed in `opaque`."""

    _FREE = frozenset({"empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full",
                       "full_like", "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full",
                       "scalar_tensor", "arange", "detach", "lift_fresh", "lift_fresh_copy", "_local_scalar_dense",
                       "_to_copy", "clone", "copy_", "copy", "_unsafe_view", "alias", "set_", "cat", "stack",
                       "split_with_sizes_copy", "unbind_copy"})

    def __init__(self):
        from collections import Counter
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import flop_registry

        counter = self
        self.matmul: Counter = Counter()
        self.other: Counter = Counter()
        self.opaque: Counter = Counter()
        formulas = {**flop_registry, torch.ops.aten._grouped_mm: _grouped_mm_flops}  # (*args, out_val=, **kwargs)

        aten = torch.ops.aten
        metadata = {aten.sym_is_contiguous.default, aten.is_contiguous.default, aten.is_contiguous.memory_format,
                    aten.is_strides_like_format.default, aten.is_non_overlapping_and_dense.default,
                    aten.size.default, aten.sym_size.default, aten.stride.default, aten.sym_stride.default,
                    aten.storage_offset.default, aten.sym_storage_offset.default, aten.numel.default,
                    aten.sym_numel.default, aten.dim.default, torch.ops.prim.layout.default}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func in metadata:  # as FlopCounterMode: a wrapper subclass (LocalTensor) answers these itself
                    return NotImplemented
                packet = func._overloadpacket
                if packet not in formulas and func.namespace == "aten" and func is not torch.ops.prim.device.default:
                    with self:
                        r = func.decompose(*args, **kwargs)  # CompositeImplicit ops: count what they are made of
                    if r is not NotImplemented:
                        return r
                out = func(*args, **kwargs)
                counter._count(func, packet, formulas, args, kwargs, out)
                return out

        self._mode = Mode()

    def _count(self, func, packet, formulas, args, kwargs, out) -> None:
        from torch.utils import _pytree as pytree
        name = packet.__name__
        if packet in formulas:
            self.matmul[name] += int(formulas[packet](*args, **kwargs, out_val=out))
        elif func.namespace != "aten":
            if func.namespace not in ("_c10d_functional", "c10d", "_dtensor", "profiler"):
                self.opaque[f"{func.namespace}.{name}"] += 1
        elif name.startswith("_embedding_bag"):
            self.other[name] += _bag_gathers(args)
        elif not func.is_view and name not in self._FREE and not name.startswith(("_foreach", "sym_")):
            sizes = [_numel(t) for t in pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            if sizes:
                self.other[name] += max(sizes)

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.matmul.values()) + sum(self.other.values())


# ----------------------------------------------------------------------------- one row: one device, then each plan

WORLD = 2
PLANS = ("dp", "fsdp", "megatron", "auto")
MESH_NAMES = {"dp": ("dp",), "fsdp": ("dp",), "megatron": ("tp",), "auto": ("dp",), "zero1": ("dp",), "zero2": ("dp",)}
# ZeRO-1/2 on the rows whose structures differ most (convolutions and norms, attention, recurrence, bags): every
# row passed them when they were added; these keep the class covered at a fraction of the suite's time.
ZERO_PLANS = ("zero1", "zero2")
ZERO_ROWS = ("resnet", "vit", "unet", "lstm_lm", "transformer", "embedding_bag", "rmsnorm_llama", "convnet")
# where each rank must run at most 1/WORLD + FLOP_SLACK of one device's FLOPs
FLOP_PLANS = ("dp", "fsdp", "zero1", "zero2")
FLOP_SLACK = 0.02
TOL = 1e-10  # fp64 end to end: the loss, every gradient, every parameter after the step
LR = 0.1


@dataclass
class Reference:
    """One device: the loss, every gradient, every parameter after one SGD step, the FLOPs of forward + backward of
    the model (`flops`) and of autopar's program for it on a 1-rank mesh (`program_flops`: the same capture and
    decompositions as the ranks' program, e.g. nn.RMSNorm written out in pointwise ops, which does more
    element work than a fused kernel)."""

    loss: float
    grads: dict[str, torch.Tensor]
    params: dict[str, torch.Tensor]
    flops: FlopCount
    program_flops: FlopCount


@dataclass
class PlanRun:
    plan: str
    errs: dict[str, float]  # "loss", "grad NAME", "param NAME": max abs difference from one device over the ranks
    flops: FlopCount | None  # one rank's forward + backward (None: not counted, a plan outside FLOP_PLANS)
    fraction: float | None  # flops.total / the 1-rank program's (Reference.program_flops)
    matmul_fraction: float | None  # matmul FLOPs / the single-device model's
    notes: list[str]  # the plan's notes that say a structure is replicated or gathered
    forms: str
    ops: list[str]

    @property
    def max_err(self) -> float:
        return max(self.errs.values())

    def off(self, tol: float = TOL) -> dict[str, float]:
        return {k: v for k, v in self.errs.items() if not v <= tol}  # NaN is off too


def reference(name: str, world) -> Reference:
    """The single-device run of row `name`, and autopar's `dp` program for it on 1 rank (`world(1)`: see `run_plan`);
    call it outside any simulated world."""
    import autopar
    from torch.distributed.device_mesh import init_device_mesh

    model, inputs = CENSUS[name].build()
    with FlopCount() as fc:
        loss = model(*inputs)
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert len(grads) == len(list(model.parameters())), f"{name}: a parameter gets no gradient on one device"
    torch.optim.SGD(model.parameters(), lr=LR).step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    model, inputs = CENSUS[name].build()
    with world(1):
        pm = autopar.parallelize(model, init_device_mesh("cpu", (1,), mesh_dim_names=("dp",)), inputs, plan="dp")
        with FlopCount() as program:
            pm(*inputs).backward()
    return Reference(float(loss.detach()), grads, params, fc, program)


def _worst(t: torch.Tensor) -> float:
    """Max over every simulated rank (LocalTensor) or this rank's value."""
    lt = getattr(t, "_local_tensors", None)
    if lt is not None:
        return max(float(v) for v in lt.values())
    return float(t)


def _ops_of(gm) -> list[str]:
    return sorted({str(n.target).removeprefix("aten.") for n in gm.graph.nodes if n.op == "call_function"
                   and isinstance(n.target, torch._ops.OpOverload)})


def _forms(plan) -> str:
    from collections import Counter
    by_kind: dict[str, Counter] = {}
    for s in plan.strategies:
        by_kind.setdefault(s.kind, Counter())[s.form] += 1
    return ", ".join(f"{k}: " + " ".join(f"{f} x{n}" if n > 1 else f for f, n in sorted(c.items()))
                     for k, c in sorted(by_kind.items()))


def run_plan(name: str, plan: str, ref: Reference, world) -> PlanRun:
    """Row `name` parallelised by `plan` on WORLD simulated ranks, one step next to `ref`: the errors, one rank's
    FLOPs, the plan's replication notes. `world(WORLD)` enters the simulated ranks (fake process group +
    LocalTensorMode: `tests/conftest.py`'s `local_world`); the model and inputs are built before, outside it."""
    import autopar
    from torch.distributed.device_mesh import init_device_mesh

    model, inputs = CENSUS[name].build()
    with world(WORLD):
        mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=MESH_NAMES[plan])
        pm = autopar.parallelize(model, mesh, inputs, plan=plan, cluster="cpu" if plan == "auto" else None)
        # FLOPs are checked under the data-parallel plans only (FLOP_PLANS): the counter (a dispatch mode that
        # also decomposes composite ops) is not run under the others
        with FlopCount() if plan in FLOP_PLANS else contextlib.nullcontext() as fc:
            loss = pm(*inputs)
            loss.backward()
        errs = {"loss": _worst((loss.detach() - ref.loss).abs())}
        params = dict(pm.named_parameters())
        assert set(params) == set(ref.params), f"parameter names changed: {sorted(set(params) ^ set(ref.params))}"
        for n, p in params.items():
            errs[f"grad {n}"] = float("inf") if p.grad is None else \
                _worst((p.grad.full_tensor() - ref.grads[n]).abs().max())
        torch.optim.SGD(pm.parameters(), lr=LR).step()
        for n, p in params.items():
            errs[f"param {n}"] = _worst((p.full_tensor() - ref.params[n]).abs().max())
    ops = _ops_of(pm._current.captured.gm)
    notes = [n for n in pm.plan.notes if "replicat" in n.lower() or "gather" in n.lower()]
    if fc is None:
        return PlanRun(plan, errs, None, None, None, notes, _forms(pm.plan), ops)
    matmul = sum(fc.matmul.values()) / max(1, sum(ref.flops.matmul.values()))
    return PlanRun(plan, errs, fc, fc.total / ref.program_flops.total, matmul, notes, _forms(pm.plan), ops)


_GATHERED_OP = re.compile(r"replicated \S+ \(([\w.]+)\) in .*its sharded inputs are gathered")
_OPAQUE = re.compile(r"(\S+) captured as one opaque node, replicated on every rank")


def gathered(notes: list[str]) -> list[str]:
    """What a plan's notes say runs whole on every rank, its sharded inputs gathered: ops without a sharding rule
    ("replicated rms_norm (aten.rms_norm.default) in body.1: no sharding rule, its sharded inputs are gathered":
    `rms_norm`; a custom op by its namespace and name) and opaque nodes ("loss captured as one opaque node,
    replicated on every rank: ...": `opaque loss`), each once."""
    found = []
    for n in notes:
        m = _GATHERED_OP.search(n)
        if m:
            namespace, name = m.group(1).split(".")[:2]
            found.append(name if namespace == "aten" else f"{namespace}.{name}")
        m = _OPAQUE.search(n)
        if m:
            found.append(f"opaque {m.group(1)}")
    return list(dict.fromkeys(found))


def flop_problem(run: PlanRun, ref: Reference) -> str:
    """Empty when one rank runs at most 1/WORLD + FLOP_SLACK of one device's FLOPs: of the 1-rank program's FLOPs
    (matmul and element ops, `run.fraction`), and of the model's matmul FLOPs on one device (`run.matmul_fraction`:
    the literal single-device count, which no decomposition changes); else the ops that run more than their share."""
    bound = 1 / WORLD + FLOP_SLACK
    if run.fraction <= bound and run.matmul_fraction <= bound and not run.flops.opaque:
        return ""
    worst = []
    for kind in ("matmul", "other"):
        mine, one = getattr(run.flops, kind), getattr(ref.program_flops, kind)
        for op in set(mine) | set(one):
            extra = mine[op] - one[op] / WORLD
            if extra > 0:
                worst.append((extra / ref.program_flops.total, op))
    worst.sort(reverse=True)
    parts = [f"{op} +{share:.3f}" for share, op in worst[:5]]
    msg = (f"one rank runs {run.fraction:.3f} of the 1-rank program's FLOPs and {run.matmul_fraction:.3f} of one "
           f"device's matmul FLOPs (bound {bound:.2f}); over 1/{WORLD}: " + ", ".join(parts))
    if run.flops.opaque:
        msg += f"; uncounted custom ops: {dict(run.flops.opaque)}"
    return msg
