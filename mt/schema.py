"""The typed configuration schema: every setting of the pipeline, its type and its default.

Plain dataclasses, no Hydra, no I/O, so the model and the other pure pieces can import it;
``mt.config`` registers them with Hydra, so a misspelt key or a wrong type fails when the
configuration is composed, naming the key. The defaults are the paper's where it has one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class SplitsConfig:
    """Which split plays which role. A value names a file prefix (local text), a HF split name,
    or a list of them (concatenated). A training corpus may be ``{name: NAME, weight: W}``: W
    times its pairs in each epoch (mt.data.mixing)."""

    train: Any = "train"
    valid: Any = "valid"
    test: Any = "test"


@dataclass
class CleanConfig:
    """Training-pair filters. Valid and test sets are never filtered."""

    normalize: bool = True  # Unicode NFC on every line (all splits)
    min_len: int = 1  # drop pairs with a side shorter than this (in whitespace words)
    max_len: int = 250  # drop pairs with a side longer than this (in whitespace words)
    max_ratio: float = 3.0  # drop pairs whose word-length ratio exceeds this (0 = off)
    dedup: bool = False  # drop exact duplicate (src, tgt) pairs
    # WMT recipe (fairseq's prepare-wmt14en2de.sh), via sacremoses; applied to every split's
    # text before encoding (train, and the valid/test sources; references stay raw for scoring).
    moses_punct: bool = False  # Moses normalize-punctuation (per language)
    remove_non_printing: bool = False  # Moses remove-non-printing-char (Unicode category C)
    # clean-corpus-n on SentencePiece pieces after encoding (train only): 0 = off.
    max_pieces: int = 0  # drop pairs with a side longer than this many pieces (fairseq: 250)
    max_piece_ratio: float = 0.0  # drop pairs whose piece-length ratio exceeds this (fairseq: 1.5)


@dataclass
class DataConfig:
    """Where the parallel text comes from and how it is cleaned."""

    name: str = "multi30k"  # a label for logs and the cache
    source: str = "auto"  # auto (local dir if present, else hub) | local | hf
    dir: Optional[str] = None  # local corpus directory with <split>.<lang> files (or TSV)
    format: str = "text"  # text: <split>.<lang> files | tsv: <split>.tsv with src<TAB>tgt
    hf_path: Optional[str] = None  # datasets.load_dataset path, e.g. wmt14
    hf_name: Optional[str] = None  # datasets config name, e.g. de-en
    hf_schema: str = "translation"  # translation: {lang: text} column | columns: one per lang
    hf_splits: Optional[SplitsConfig] = None  # HF split names when they differ from `splits`
    hf_data_files: Optional[Any] = None  # local files for hf_path=parquet|json: {split: path(s)}
    hf_data_dir: Optional[str] = None  # a folder of the dataset repository (datasets' data_dir)
    # The hub dataset's revision (a branch, tag or commit; null: main). The commit it resolves
    # to is part of the prepared data's cache key and recorded in its meta.json.
    revision: Optional[str] = None
    src_lang: str = "de"
    tgt_lang: str = "en"
    # Many directions in one model: [de-en, en-de] (or {name: de-en, weight: W}) read from the
    # same splits, each source line behind its target language's token <2en> (empty: the one
    # direction src_lang -> tgt_lang)
    directions: list = field(default_factory=list)
    splits: SplitsConfig = field(default_factory=SplitsConfig)
    # T-sampling over the training corpora: corpus i's share of an epoch ~ (w_i n_i)^(1/T) (1 =
    # sizes times weights; larger flattens towards uniform; the epoch keeps its size)
    corpus_temperature: float = 1.0
    max_train_pairs: Optional[int] = None  # keep the first N pairs of each training corpus
    errors: str = "strict"  # strict: non-UTF-8 bytes are an error | replace: warn and replace
    # Prepared data checked at each start: quick (sizes, the meta's digest, a CRC of files whose
    # time changed) | full (a CRC of every file)
    verify: str = "quick"
    clean: CleanConfig = field(default_factory=CleanConfig)


@dataclass
class TokenizerConfig:
    """SentencePiece settings (one joint model by default, for the shared embedding)."""

    type: str = "bpe"  # bpe | unigram
    vocab_size: int = 8000
    character_coverage: float = 1.0  # 0.9995-0.9999 for noisy web text (rare chars -> bytes)
    input_sentence_size: int = 1_000_000  # train on a random sample of at most this many lines
    shuffle: bool = True  # sample input_sentence_size lines at random (false: the first ones)
    seed: int = 1  # SentencePiece's random seed (the sample), stored in meta.json
    reuse: Optional[str] = None  # a checkpoint or .model file whose SentencePiece model to reuse
    joint: bool = True  # one model for both languages (false: one per language)
    threads: int = 0  # encoding/training threads (0 = all cores)
    byte_fallback: bool = True  # unknown characters become UTF-8 byte pieces (no <unk>)
    # Pieces kept whole wherever they occur, e.g. [<BT>], the tag of back-translated sources
    user_symbols: list = field(default_factory=list)
    # Subword regularisation of the training split (valid, test and decoding never): bpe,
    # BPE-dropout (each merge skipped with this probability); unigram, sampling smoothed by it
    sampling_alpha: float = 0.0  # 0 = off (one deterministic encoding)
    sampled_copies: int = 16  # sampled encodings made when preparing; epoch e reads e mod this


@dataclass
class ModelConfig:
    """The Transformer's shape, with the paper's symbols."""

    N: int = 6  # layers in the encoder and in the decoder
    N_dec: Optional[int] = None  # decoder layers when different from N
    d_model: int = 512
    d_ff: int = 2048
    h: int = 8  # attention heads; d_k = d_v = d_model / h
    dropout: float = 0.1  # every dropout of the model (0 turns all off)
    attention_dropout: Optional[float] = None  # dropout on attention weights (None: = dropout)
    norm: str = "post"  # post (the paper) | pre (pre-LN with final LayerNorms)
    share_embeddings: bool = True  # one matrix for source, target and output projection
    max_positions: int = 1024  # longest sequence the positional encoding covers
    vocab_multiple: int = 8  # pad the vocabulary to a multiple of this (speed)


def attention_dropout(cfg: ModelConfig) -> float:
    """The dropout on attention weights: ``cfg.attention_dropout``, or ``cfg.dropout`` if None."""
    return cfg.dropout if cfg.attention_dropout is None else cfg.attention_dropout


@dataclass
class TrainConfig:
    """Optimisation, logging, checkpointing."""

    seed: int = 1
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int = 0  # torch intra-op threads on CPU (0 = torch's default)
    max_tokens: int = 4096  # padded tokens per batch and per rank (source and target each)
    accum_steps: int = 1  # batches per update (gradient accumulation)
    # Global batch, the paper's way: padded target tokens per update over all ranks (~25000 for
    # the paper's base); accum_steps (and a smaller max_tokens) follow for any number of ranks,
    # see mt.data.batches.batch_plan. 0 = off: max_tokens and accum_steps as given.
    batch_tokens: int = 0
    prefetch: int = 2  # batches collated ahead in a background thread (0 = in the loop's thread)
    dist_timeout_minutes: float = 30.0  # DDP collective timeout (torchrun runs)
    max_steps: int = 0  # stop after this many updates (0 = no limit)
    max_epochs: int = 0  # stop after this many epochs (0 = no limit)
    max_minutes: float = 0.0  # stop after this much training time (0 = no limit)
    skip_long: bool = True  # skip training pairs longer than model.max_positions (logged)
    # Optimiser: Adam (beta1, beta2, eps) as in the paper.
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-9
    weight_decay: float = 0.0
    # true: decoupled, as fairseq's Adam and AdamW (Loshchilov & Hutter 2019): p -= lr * wd * p
    # beside Adam's step; false: an L2 term wd * p added to the gradient (torch's plain Adam).
    decoupled_weight_decay: bool = True
    clip_norm: float = 0.0  # gradient-norm clipping (0 = off)
    # Schedule: lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) ("Noam").
    warmup: int = 4000
    factor: float = 1.0
    lr: Optional[float] = None  # peak lr; when set, overrides factor (peak reached at warmup)
    # Cool-down: over the last `cooldown` share of the budget (max_steps or max_minutes,
    # whichever is nearer) the rate falls linearly to 0 (0 = off: the plain Noam tail).
    cooldown: float = 0.0
    label_smoothing: float = 0.1
    # fp32 | bf16 | fp16 (a dynamic loss scale) | auto (bf16 where the device has native
    # bfloat16: CUDA Ampere+, CPUs with AVX512-BF16 or AMX; fp32 elsewhere, e.g. AVX2 CPUs)
    precision: str = "fp32"
    # bf16/fp16: the passes on a 16-bit copy of the model, Adam on float32 master weights
    # (fairseq's --bf16, apex O2; mt.fast.master) instead of autocast over float32 weights
    master_weights: bool = False
    compile: bool = False  # torch.compile the model
    pad_multiple: int = 0  # pad batch lengths to a multiple of this (0 or 1: none)
    # Batches padded to one of K (sentences, source, target) shapes made from the corpus's
    # lengths (mt.data.buckets): few shapes for compiled steps and CUDA graphs. 0 = off.
    shape_buckets: int = 0
    # CUDA with batch_tokens: each GPU's batch the largest the memory model (mt.fast.footprint)
    # fits, up to its share of the global batch; accum_steps keeps the global batch
    fit_batch: bool = False
    tf32: bool = True  # CUDA: float32 matrix products on TF32 tensor cores
    # CPU training copy (mt.fast): products on oneDNN or torch (measured), 16-bit dropout masks
    cpu_kernels: bool = True
    # Each encoder and decoder layer keeps only its input for the backward pass and runs its
    # forward pass again there (fairseq's --checkpoint-activations): far less activation memory
    # for about one more forward pass per step (mt.fast.recompute); the same gradients
    activation_checkpointing: bool = False
    # Logging, validation, checkpoints. tracking: besides metrics.jsonl (tensorboard, mlflow)
    tracking: list = field(default_factory=lambda: ["tensorboard"])
    tracking_uri: str = ""  # MLflow's tracking URI ("": a file store in run_dir/mlruns)
    log_every: int = 50
    eval_every: int = 1000  # validate every N updates (0 = only at the end)
    eval_bleu: bool = True  # decode the valid set at each validation (train.valid_beam) for BLEU
    eval_max_sentences: int = 0  # decode at most this many valid sentences (0 = all)
    save_every: int = 1000  # write checkpoints/last.pt every N updates (0 = at the end only)
    keep_last: int = 5  # keep the last N periodic checkpoints (checkpoint_<step>.pt)
    best_metric: str = "bleu"  # bleu (higher is better) | chrf (higher is better) | loss (lower)
    # Validation's search: null = greedy; a beam size K = beam search with decode's settings
    # (decode.alpha, max_len_a/b, batch_size, max_tokens, kernels) at beam_size K, nbest 1
    valid_beam: Optional[int] = None
    patience: int = 0  # stop after N validations without improvement (0 = off)
    average_last: int = 0  # at the end, average the last N periodic checkpoints (0 = off)
    # An exponential moving average of the weights with this decay (0 = off; mt.train.ema):
    # validated at the end, ema.pt, best.pt when at least as good (fairseq's --ema-decay)
    ema: float = 0.0
    init_from: Optional[str] = None  # fine-tune: start from these weights, fresh optimiser
    # On resume, start these afresh: optimizer (Adam's moments), schedule (warm-up again),
    # meters (best value, patience), data (a new epoch order); once, not again for a run started
    # with the same list (a requeued job's command line) unless reset_again (mt.train.state)
    reset: list = field(default_factory=list)
    reset_again: bool = False  # apply train.reset on this resume even if it was applied
    max_nonfinite: int = 10  # stop after this many consecutive non-finite updates
    # mt-train ends with mt-evaluate's work on the run (eval.split with eval.checkpoint or
    # best.pt: results.json); `make train ARGS="-m ..."` sets it, one evaluation per trial
    evaluate: bool = False
    # fp16: stop when the dynamic loss scale falls below this (fairseq's --min-loss-scale):
    # the gradients overflow at every scale; fp16 overflows do not count as non-finite updates
    min_loss_scale: float = 1e-4


@dataclass
class DecodeConfig:
    """Search settings for validation BLEU, evaluation and mt-translate."""

    beam_size: int = 4  # 1 = greedy search
    alpha: float = 0.6  # length penalty: score = log p(Y) / |Y| ^ alpha (|Y| with EOS)
    max_len_a: float = 1.0  # maximum output length = a * src_len + b
    max_len_b: int = 50
    nbest: int = 1  # hypotheses written per sentence (mt-translate)
    batch_size: int = 64  # sentences per decoding batch
    max_tokens: int = 0  # source tokens per decoding batch (0 = use batch_size)
    too_long: str = "error"  # error | truncate: inputs longer than model.max_positions
    # fp32 | bf16 | fp16 (autocast) | auto (bf16 on a CUDA GPU with native bfloat16, else fp32)
    precision: str = "fp32"
    # CPU: batches decoded side by side by this many workers sharing torch's intra-op threads
    # (CTranslate2's inter_threads): forked processes where this process may fork, else threads
    # (mt.decode.driver.forks_workers); 0 = auto: one per intra-op thread on a CPU, 1 on a GPU
    workers: int = 0
    # A vocabulary shortlist (Marian's lexical shortlist): each batch searches only the target
    # pieces its sources can become (mt.decode.shortlist). A lexicon file, or "train": the
    # prepared training data's, built on first use; null = the whole vocabulary.
    shortlist: Optional[str] = None
    shortlist_k: int = 50  # per source piece, its most probable translations (IBM model 1)
    shortlist_frequent: int = 3000  # and the most frequent target pieces, always
    # Sampling (decode=sample): one draw per sentence instead of a search.
    sample: bool = False  # sample translations (beam_size is then ignored)
    temperature: float = 1.0  # p ~ exp(log p / temperature); 0 = greedy
    top_k: int = 0  # sample among the k most probable tokens only (0 = all)
    top_p: float = 1.0  # ... and among the smallest set reaching this probability (1 = all)
    seed: int = 0  # the same seed gives the same samples, however the input is batched


@dataclass
class EngineConfig:
    """Which engine decodes a command's requests (mt.decode.engine): mt's torch search, or
    CTranslate2 on the checkpoint converted once (cached beside it, keyed by its bytes and the
    compute type). The settings of mt-translate (``translate.*``), mt-serve (``serve.*``) and
    mt-score (``score.*``)."""

    # auto: CTranslate2 where it is installed and can run the request's settings, torch
    # otherwise (one log line says which and why) | torch | ctranslate2 (an error naming what
    # it cannot run)
    engine: str = "auto"
    # CTranslate2's compute type: auto (float32 on a CPU: the torch search's translations;
    # float16 on a GPU) | float32 | int8 | int8_float32 | int8_float16, float16 (GPU only)
    compute_type: str = "auto"
    # CTranslate2's CPU threads: replicas decoding batches side by side (inter) and threads per
    # replica (intra); 0 = auto (mt.decode.engine.threads)
    inter_threads: int = 0
    intra_threads: int = 0


@dataclass
class ServeConfig(EngineConfig):
    """mt-serve: what it serves and where, limits on a request (each a 4xx with a JSON error
    when exceeded) and batching."""

    checkpoint: Optional[str] = None  # default: <run_dir>/checkpoints/best.pt
    host: str = "127.0.0.1"  # the address to listen on (loopback unless told)
    port: int = 8000
    max_body_bytes: int = 65536  # a larger request body is refused (413)
    max_sentences: int = 32  # sentences in one request
    max_chars: int = 1000  # characters in one sentence (and tokens: model.max_positions - 1)
    max_beam: int = 8  # largest beam_size a request may ask for (nbest <= beam_size)
    batch_sentences: int = 64  # the decoding queue forms batches of up to this many sentences
    batch_wait_ms: float = 5.0  # and waits this long for more requests after the first
    queue_size: int = 256  # sentences waiting at most; more gets 503 (never unbounded memory)


@dataclass
class EvalConfig:
    """mt-evaluate: what it decodes or reads, and how it scores (sacreBLEU on detokenized text;
    each score with its signature). Validation during training scores with the same metric
    settings."""

    checkpoint: Optional[str] = None  # default: <run_dir>/checkpoints/best.pt
    split: str = "test"  # the split decoded and scored: valid | test
    hyp: Optional[str] = None  # score this translation file instead of decoding
    ref: Any = None  # reference file(s) for hyp=, or a sacreBLEU test set (wmt14/full), cached
    output: Optional[str] = None  # hyp= mode: also write the JSON results here
    report: bool = True  # write report.md with plots into the run directory
    metrics: list = field(default_factory=lambda: ["bleu", "chrf"])  # bleu chrf chrf++ ter
    bleu_tokenize: str = "13a"  # sacreBLEU's BLEU tokenizer: 13a | intl | zh | char | ...
    # Also the papers' tokenized BLEU with compound splitting (WMT14 en-de; NOT comparable
    # with sacreBLEU, labelled so in results.json).
    compound_split_bleu: bool = False


@dataclass
class TranslateConfig(EngineConfig):
    """mt-translate: the model, the input and output, and what else to write."""

    # A checkpoint file (default: <run_dir>/checkpoints/best.pt), or a list, [a.pt,b.pt]: an
    # ensemble averaging the models' log-probabilities.
    checkpoint: Any = None
    input: Optional[str] = None  # input file (default stdin)
    output: Optional[str] = None  # output file (default stdout)
    attention: Optional[str] = None  # draw the first sentence's attention here (PNG)
    alignment: Optional[str] = None  # write word alignments (Pharaoh i-j) here
    alignment_layer: int = -1  # the decoder layer whose cross-attention aligns (-1: the last)
    prefix: Optional[str] = None  # a file of target prefixes, one per input line
    interactive: Optional[bool] = None  # one line at a time (None: when stdin is a terminal)
    target_lang: Optional[str] = None  # a many-direction model's target language (its <2xx>)


@dataclass
class ScoreConfig(EngineConfig):
    """mt-score: the model's log-probability of given translations."""

    checkpoint: Any = None  # a checkpoint (default: <run_dir>/checkpoints/best.pt) or a list
    src: Optional[str] = None  # the source file
    tgt: Optional[str] = None  # the target file whose log-probabilities are scored
    output: Optional[str] = None  # default stdout


@dataclass
class ExportConfig:
    """mt-export: a checkpoint out of mt."""

    checkpoint: Optional[str] = None  # the checkpoint to export (required)
    format: Optional[str] = None  # hf | ctranslate2 (required)
    output: Optional[str] = None  # the directory to write (required)
    # ctranslate2: a lexicon file (decode.shortlist's) also written as CTranslate2's vocabulary
    # map, decode.shortlist_k translations per piece and decode.shortlist_frequent always
    shortlist: Optional[str] = None
    # hf: the model card's license, a hub license id (mit, apache-2.0, cc-by-4.0, other...);
    # the training data's terms decide what it may be, so it is never guessed
    license: str = "unknown"


@dataclass
class BacktranslateConfig:
    """mt-backtranslate: a reverse (target -> source) model turns monolingual target-side text
    into a synthetic parallel corpus (mt.decode.backtranslate); the search is ``decode.*``
    (``decode=sample`` for sampled back-translation)."""

    checkpoint: Optional[str] = None  # the reverse model: trained tgt_lang -> src_lang (required)
    input: Any = None  # monolingual text in data.tgt_lang: a file or a list (required)
    output: Optional[str] = None  # directory for <name>.<src_lang> and <name>.<tgt_lang>
    name: str = "bt"  # the corpus's file prefix (a split name for data.splits.train)
    tag: Optional[str] = None  # e.g. "<BT>": starts every synthetic source (tagged BT)
    noise: bool = False  # Edunov et al.'s noise on the output: drop 0.1, filler 0.1, shuffle 3
    filler: str = "<blank>"  # the word that noise puts in place of a blanked one
    max_lines: int = 0  # translate at most this many non-empty lines (0 = all)
    check_language: bool = True  # refuse input that reads as the source language


# The node holding each command's own settings: ``mt-translate input=x`` is
# ``translate.input=x`` (see mt.config.command_overrides).
COMMANDS = {
    "translate": "translate", "evaluate": "eval", "score": "score", "export": "export",
    "serve": "serve", "backtranslate": "backtranslate",
}  # fmt: skip


@dataclass
class Config:
    """The whole configuration: the pipeline's settings, then each command's own."""

    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    name: str = "default"  # experiment name (a label)
    run_dir: str = "runs/default"  # where a run writes; an existing one is resumed
    cache_dir: str = ".cache/mt"  # prepared data (SentencePiece model, encoded splits)
    # The commands' own settings (mt-evaluate's are eval.*, mt-serve's serve.*).
    translate: TranslateConfig = field(default_factory=TranslateConfig)
    score: ScoreConfig = field(default_factory=ScoreConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    backtranslate: BacktranslateConfig = field(default_factory=BacktranslateConfig)
