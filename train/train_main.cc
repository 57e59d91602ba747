// rd_train: trains a small long-context language model (docs/training.md), or samples from
// one of its checkpoints:
//   rd_train [--flags]                       train (defaults: the passkey task on the CPU)
//   rd_train sample --checkpoint=DIR --prompt="..."
// Flags: --help lists them (and exits 0); --flagfile=FILE reads them from a file
// (train/configs/).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "ringdilated/dist/bootstrap.h"
#include "ringdilated/kernels/error.h"
#include "ringdilated/tensor/device.h"
#include "ringdilated/tensor/tensor.h"
#include "ringdilated/train/checkpoint.h"
#include "ringdilated/train/tokenizer.h"
#include "ringdilated/train/trainer.h"

// Data.
ABSL_FLAG(std::string, data, "passkey",
          "passkey, mqar, copy (synthetic, generated on the fly), text:<file> (bytes of a file) "
          "or tokens:<file> (an RDTOK token file)");
ABSL_FLAG(int64_t, seq_len, 256, "tokens per sequence");
ABSL_FLAG(int64_t, passkey_digits, 5, "digits of the passkey (chance is 10^-digits)");
ABSL_FLAG(int64_t, mqar_pairs, 32, "key-value pairs of the mqar task");
ABSL_FLAG(int64_t, mqar_queries, 8, "queries of the mqar task");
ABSL_FLAG(std::string, loss_on, "answers", "synthetic tasks: train on 'answers' or 'all' tokens");
ABSL_FLAG(uint64_t, data_seed, 1234, "seed of the synthetic data and of text window shuffling");
// Model.
ABSL_FLAG(int64_t, dim, 64, "model width");
ABSL_FLAG(int64_t, depth, 2, "transformer blocks");
ABSL_FLAG(int64_t, heads, 4, "attention heads");
ABSL_FLAG(double, mlp_ratio, 4.0, "MLP hidden width / model width (SwiGLU uses 2/3 of it)");
ABSL_FLAG(std::string, mlp, "swiglu", "swiglu or gelu");
ABSL_FLAG(std::vector<std::string>, segments, std::vector<std::string>({"128", "256"}),
          "segment lengths of the dilated attention pairs, comma separated");
ABSL_FLAG(std::vector<std::string>, dilations, std::vector<std::string>({"1", "2"}),
          "dilation rates, one per segment length");
ABSL_FLAG(std::string, variant, "fixed", "fixed (segment-local) or original (global) dilation");
ABSL_FLAG(std::string, mixing, "all_heads", "head_groups or all_heads");
ABSL_FLAG(double, rope_base, 10000.0, "rotary position embedding base");
ABSL_FLAG(bool, recompute, false, "recompute each block's activations in the backward");
ABSL_FLAG(int64_t, mlp_chunk_tokens, 131072,
          "with --recompute: run the MLP over sequence chunks of at most this many tokens, "
          "each recomputed on its own (0: the whole sequence at once)");
// Optimization.
ABSL_FLAG(int64_t, steps, 6000, "optimizer steps (at most: see --stop_at_exact_match)");
ABSL_FLAG(int64_t, batch_size, 4, "sequences per micro-batch on each data-parallel rank");
ABSL_FLAG(int64_t, tokens_per_step, 0,
          "target batch in tokens over every rank (gradient accumulation); 0: one micro-batch");
ABSL_FLAG(double, lr, 2e-3, "peak learning rate");
ABSL_FLAG(double, min_lr_ratio, 0.1, "the decay's floor, as a fraction of the peak");
ABSL_FLAG(int64_t, warmup_steps, 100, "linear warmup steps");
ABSL_FLAG(std::string, decay, "cosine", "cosine, linear or constant");
ABSL_FLAG(double, weight_decay, 0.1, "AdamW weight decay (not on norms and embeddings)");
ABSL_FLAG(double, grad_clip, 1.0, "global gradient-norm clip; 0: off");
ABSL_FLAG(std::string, dtype, "", "float32, bfloat16, float16; empty: the device's recommendation");
ABSL_FLAG(std::string, device, "auto", "auto (a GPU when there is one), cpu or cuda[:N]");
ABSL_FLAG(int, threads, 0, "CPU threads; 0: every core");
ABSL_FLAG(uint64_t, seed, 0, "seed of the model's initialization and dropout");
// Evaluation, logging, checkpoints.
ABSL_FLAG(int64_t, eval_every, 100, "evaluate every N steps (and at the end)");
ABSL_FLAG(int64_t, eval_batches, 16, "held-out batches (of --batch_size sequences) per evaluation");
ABSL_FLAG(double, stop_at_exact_match, 0.98,
          "stop training at the first evaluation (every --eval_every steps) whose held-out "
          "exact match is at least this, then run the final evaluation; tasks only (text has "
          "no exact match); 0: train all --steps");
ABSL_FLAG(int64_t, final_eval_batches, 64, "held-out batches of the final evaluation");
ABSL_FLAG(int64_t, log_every, 10, "progress line and metrics record every N steps");
ABSL_FLAG(int64_t, checkpoint_every, 500, "checkpoint every N steps (and at the end); 0: end only");
ABSL_FLAG(int, keep_checkpoints, 3, "checkpoints to keep");
ABSL_FLAG(std::string, out_dir, "runs/passkey", "run folder: checkpoints/, metrics.jsonl");
ABSL_FLAG(std::string, resume, "auto",
          "auto (the newest checkpoint in out_dir if any), latest (it must exist), a checkpoint "
          "folder, or empty to start over");
ABSL_FLAG(bool, allow_config_change, false,
          "resume even though data, model or optimization flags differ from the checkpoint's "
          "(without it such a resume is refused, listing each difference)");
// Parallelism.
ABSL_FLAG(int, context_parallel, 1,
          "ranks per context-parallel group (the sequence is split among them); the rest of "
          "the world is data parallel");
ABSL_FLAG(std::string, strategy, "auto", "sequence-parallel attention: ring, all_gather or auto");
ABSL_FLAG(std::string, cp_layout, "auto",
          "how context-parallel ranks split a sequence: zigzag (rank r holds pieces r and "
          "2P-1-r of 2P, balancing the causal work), contiguous, or auto (zigzag when 2P "
          "divides --seq_len)");
// Sampling (rd_train sample).
ABSL_FLAG(std::string, checkpoint, "", "sample: the checkpoint folder (or a run folder: its newest)");
ABSL_FLAG(std::string, prompt, "", "sample: the prompt text");
ABSL_FLAG(int64_t, max_new_tokens, 64, "sample: tokens to generate");
ABSL_FLAG(double, temperature, 0.0, "sample: 0 is greedy");
ABSL_FLAG(int64_t, top_k, 0, "sample: keep the k most likely tokens; 0: all");

namespace {

using rd::train::TrainConfig;

// Ctrl-C asks the trainer to stop at its next logged step, after a checkpoint. The flag is
// the one piece of global state a signal handler can set.
std::atomic<bool> g_stop_requested{false};

void on_interrupt(int) { g_stop_requested = true; }

std::vector<int64_t> parse_list(const std::vector<std::string>& items, const char* flag) {
  std::vector<int64_t> values;
  for (const std::string& item : items) {
    try {
      size_t used = 0;
      values.push_back(std::stoll(item, &used));
      if (used != item.size()) throw std::invalid_argument(item);
    } catch (const std::exception&) {
      RD_FAIL(kInvalidArgument, "--", flag, " has '", item, "', not an integer");
    }
  }
  return values;
}

// --segments and --dilations: one rate per length, each length a multiple of its rate.
void check_attention_pairs(const std::vector<int64_t>& segments, const std::vector<int64_t>& dilations) {
  RD_CHECK(!segments.empty() && segments.size() == dilations.size(), kInvalidArgument,
           "--segments has ", segments.size(), " values and --dilations ", dilations.size(),
           ": give one dilation rate per segment length");
  for (size_t i = 0; i < segments.size(); ++i) {
    RD_CHECK(segments[i] >= 1 && dilations[i] >= 1 && segments[i] % dilations[i] == 0,
             kInvalidArgument, "--segments and --dilations: pair ", i + 1, " (segment length ",
             segments[i], ", dilation ", dilations[i],
             ") needs both >= 1 and the length a multiple of the dilation");
  }
}

// Range checks of the numeric flags, naming the flag: the trainer checks its configuration
// too, but by its field names, which are not always the flags'.
void check_flag_ranges() {
  struct AtLeast {
    const char* flag;
    int64_t value, min;
    const char* meaning;  // of the smallest values, or ""
  };
  const AtLeast ints[] = {
      {"seq_len", absl::GetFlag(FLAGS_seq_len), 1, ""},
      {"passkey_digits", absl::GetFlag(FLAGS_passkey_digits), 1, ""},
      {"mqar_pairs", absl::GetFlag(FLAGS_mqar_pairs), 1, ""},
      {"mqar_queries", absl::GetFlag(FLAGS_mqar_queries), 1, ""},
      {"dim", absl::GetFlag(FLAGS_dim), 1, ""},
      {"depth", absl::GetFlag(FLAGS_depth), 1, ""},
      {"heads", absl::GetFlag(FLAGS_heads), 1, ""},
      {"mlp_chunk_tokens", absl::GetFlag(FLAGS_mlp_chunk_tokens), 0, " (0: the whole sequence)"},
      {"steps", absl::GetFlag(FLAGS_steps), 1, ""},
      {"batch_size", absl::GetFlag(FLAGS_batch_size), 1, ""},
      {"tokens_per_step", absl::GetFlag(FLAGS_tokens_per_step), 0, " (0: one micro-batch)"},
      {"warmup_steps", absl::GetFlag(FLAGS_warmup_steps), 0, ""},
      {"eval_every", absl::GetFlag(FLAGS_eval_every), 0, " (0: only at the end)"},
      {"eval_batches", absl::GetFlag(FLAGS_eval_batches), 1, ""},
      {"final_eval_batches", absl::GetFlag(FLAGS_final_eval_batches), 1, ""},
      {"log_every", absl::GetFlag(FLAGS_log_every), 1, ""},
      {"checkpoint_every", absl::GetFlag(FLAGS_checkpoint_every), 0, " (0: only at the end)"},
      {"keep_checkpoints", absl::GetFlag(FLAGS_keep_checkpoints), 1, ""},
      {"threads", absl::GetFlag(FLAGS_threads), 0, " (0: every core)"},
      {"context_parallel", absl::GetFlag(FLAGS_context_parallel), 1,
       " (ranks per context-parallel group; 1: none)"},
      {"max_new_tokens", absl::GetFlag(FLAGS_max_new_tokens), 0, ""},
      {"top_k", absl::GetFlag(FLAGS_top_k), 0, " (0: every token)"}};
  for (const AtLeast& f : ints) {
    RD_CHECK(f.value >= f.min, kInvalidArgument, "--", f.flag, " must be >= ", f.min, f.meaning,
             ", got ", f.value);
  }
  struct Within {
    const char* flag;
    double value, low, high;
    bool low_open;  // value > low rather than >= low
  };
  const double inf = INFINITY;
  const Within reals[] = {{"lr", absl::GetFlag(FLAGS_lr), 0, inf, true},
                          {"min_lr_ratio", absl::GetFlag(FLAGS_min_lr_ratio), 0, 1, false},
                          {"weight_decay", absl::GetFlag(FLAGS_weight_decay), 0, inf, false},
                          {"grad_clip", absl::GetFlag(FLAGS_grad_clip), 0, inf, false},
                          {"mlp_ratio", absl::GetFlag(FLAGS_mlp_ratio), 0, inf, true},
                          {"rope_base", absl::GetFlag(FLAGS_rope_base), 1, inf, true},
                          {"temperature", absl::GetFlag(FLAGS_temperature), 0, inf, false},
                          {"stop_at_exact_match", absl::GetFlag(FLAGS_stop_at_exact_match), 0, 1, false}};
  for (const Within& f : reals) {
    const bool above = f.low_open ? f.value > f.low : f.value >= f.low;
    RD_CHECK(std::isfinite(f.value) && above && f.value <= f.high, kInvalidArgument, "--", f.flag,
             " must be ", f.low_open ? "> " : ">= ", f.low,
             std::isfinite(f.high) ? rd::str_cat(" and <= ", f.high) : std::string(), ", got ", f.value);
  }
}

// --device: auto, cpu, cuda or cuda:N; a GPU asked for must be visible (checked here, before
// any data is read or generated).
rd::Device parse_device(const std::string& name) {
  if (name == "auto") return rd::cuda_available() ? rd::Device::cuda(0) : rd::Device::cpu();
  if (name == "cpu") return rd::Device::cpu();
  const std::string_view index = name == "cuda" ? "0" : std::string_view(name).substr(5);
  RD_CHECK((name == "cuda" || name.rfind("cuda:", 0) == 0) && !index.empty() && index.size() <= 4 &&
               index.find_first_not_of("0123456789") == std::string_view::npos,
           kInvalidArgument, "--device must be auto, cpu or cuda[:N], got '", name, "'");
  const int device = std::stoi(std::string(index));
  const int count = rd::cuda_device_count();
#if defined(RD_WITH_CUDA)
  const char* none = "no CUDA GPU is visible";
#else
  const char* none = "this build has no CUDA backend (the cpu preset)";
#endif
  RD_CHECK(device < count, kDeviceMismatch, "--device=", name, ": ",
           count == 0 ? std::string(none) + "; use --device=cpu (or auto)"
                      : rd::str_cat("only ", count, " CUDA GPUs are visible (cuda:0 to cuda:", count - 1, ")"));
  return rd::Device::cuda(device);
}

template <class E>
E pick(const std::string& value, const char* flag,
       std::initializer_list<std::pair<const char*, E>> choices) {
  std::string names;
  for (const auto& [name, e] : choices) {
    if (value == name) return e;
    names += std::string(names.empty() ? "" : ", ") + name;
  }
  RD_FAIL(kInvalidArgument, "--", flag, " must be one of ", names, ", got '", value, "'");
}

TrainConfig config_from_flags() {
  check_flag_ranges();
  TrainConfig c;
  c.data = absl::GetFlag(FLAGS_data);
  c.data_options.task.seq_len = absl::GetFlag(FLAGS_seq_len);
  c.data_options.task.passkey_digits = absl::GetFlag(FLAGS_passkey_digits);
  c.data_options.task.mqar_pairs = absl::GetFlag(FLAGS_mqar_pairs);
  c.data_options.task.mqar_queries = absl::GetFlag(FLAGS_mqar_queries);
  c.data_options.loss_on = pick<rd::train::LossOn>(absl::GetFlag(FLAGS_loss_on), "loss_on",
                                                   {{"answers", rd::train::LossOn::kAnswers},
                                                    {"all", rd::train::LossOn::kAll}});
  c.data_options.seed = absl::GetFlag(FLAGS_data_seed);
  c.model.dim = absl::GetFlag(FLAGS_dim);
  c.model.depth = absl::GetFlag(FLAGS_depth);
  c.model.heads = absl::GetFlag(FLAGS_heads);
  c.model.mlp_ratio = absl::GetFlag(FLAGS_mlp_ratio);
  c.model.mlp = pick<rd::nn::MLPActivation>(absl::GetFlag(FLAGS_mlp), "mlp",
                                            {{"swiglu", rd::nn::MLPActivation::kSwiGLU},
                                             {"gelu", rd::nn::MLPActivation::kGelu}});
  c.model.attention.segment_lengths = parse_list(absl::GetFlag(FLAGS_segments), "segments");
  c.model.attention.dilation_rates = parse_list(absl::GetFlag(FLAGS_dilations), "dilations");
  check_attention_pairs(c.model.attention.segment_lengths, c.model.attention.dilation_rates);
  c.model.attention.variant = pick<rd::nn::DilationVariant>(
      absl::GetFlag(FLAGS_variant), "variant",
      {{"fixed", rd::nn::DilationVariant::kSegmentLocal}, {"original", rd::nn::DilationVariant::kGlobal}});
  c.model.attention.mixing = pick<rd::nn::HeadMixing>(
      absl::GetFlag(FLAGS_mixing), "mixing",
      {{"head_groups", rd::nn::HeadMixing::kHeadGroups}, {"all_heads", rd::nn::HeadMixing::kAllHeads}});
  c.model.rope_base = absl::GetFlag(FLAGS_rope_base);
  c.model.recompute = absl::GetFlag(FLAGS_recompute);
  c.model.mlp_chunk_tokens = absl::GetFlag(FLAGS_mlp_chunk_tokens);
  c.steps = absl::GetFlag(FLAGS_steps);
  c.batch_size = absl::GetFlag(FLAGS_batch_size);
  c.tokens_per_step = absl::GetFlag(FLAGS_tokens_per_step);
  c.lr = absl::GetFlag(FLAGS_lr);
  c.min_lr_ratio = absl::GetFlag(FLAGS_min_lr_ratio);
  c.warmup_steps = absl::GetFlag(FLAGS_warmup_steps);
  c.decay = pick<rd::nn::LrDecay>(absl::GetFlag(FLAGS_decay), "decay",
                                  {{"cosine", rd::nn::LrDecay::kCosine},
                                   {"linear", rd::nn::LrDecay::kLinear},
                                   {"constant", rd::nn::LrDecay::kConstant}});
  c.weight_decay = absl::GetFlag(FLAGS_weight_decay);
  c.grad_clip = absl::GetFlag(FLAGS_grad_clip);
  c.dtype = absl::GetFlag(FLAGS_dtype);
  c.device = parse_device(absl::GetFlag(FLAGS_device));
  c.seed = absl::GetFlag(FLAGS_seed);
  c.eval_every = absl::GetFlag(FLAGS_eval_every);
  c.eval_batches = absl::GetFlag(FLAGS_eval_batches);
  c.stop_at_exact_match = absl::GetFlag(FLAGS_stop_at_exact_match);
  c.final_eval_batches = absl::GetFlag(FLAGS_final_eval_batches);
  c.log_every = absl::GetFlag(FLAGS_log_every);
  c.checkpoint_every = absl::GetFlag(FLAGS_checkpoint_every);
  c.keep_checkpoints = absl::GetFlag(FLAGS_keep_checkpoints);
  c.out_dir = absl::GetFlag(FLAGS_out_dir);
  c.resume = absl::GetFlag(FLAGS_resume);
  c.allow_config_change = absl::GetFlag(FLAGS_allow_config_change);
  c.context_parallel = absl::GetFlag(FLAGS_context_parallel);
  c.strategy = pick<rd::nn::DistStrategy>(absl::GetFlag(FLAGS_strategy), "strategy",
                                          {{"ring", rd::nn::DistStrategy::kRing},
                                           {"all_gather", rd::nn::DistStrategy::kAllGather},
                                           {"auto", rd::nn::DistStrategy::kAuto}});
  c.cp_layout = pick<rd::nn::SequenceLayout>(absl::GetFlag(FLAGS_cp_layout), "cp_layout",
                                             {{"zigzag", rd::nn::SequenceLayout::kZigzag},
                                              {"contiguous", rd::nn::SequenceLayout::kContiguous},
                                              {"auto", rd::nn::SequenceLayout::kAuto}});
  return c;
}

// The job's communicator when a launcher started several ranks (WORLD_SIZE or OMPI_*), else
// none. Ranks on GPUs use NCCL, one GPU each (LOCAL_RANK picks it); CPU ranks use Gloo.
std::shared_ptr<rd::dist::Communicator> world_from_launcher(TrainConfig& c) {
  const char* size = std::getenv("WORLD_SIZE");
  if (size == nullptr) size = std::getenv("OMPI_COMM_WORLD_SIZE");
  if (size == nullptr || std::string(size) == "1") return nullptr;
  const rd::dist::LaunchEnv env = rd::dist::launch_env_from_environment();
  rd::dist::ProcessGroupOptions options;
  if (c.device.is_cuda()) {
    c.device = rd::Device::cuda(env.local_rank);
    options.backend = "nccl";
    options.device = c.device;
  }
  return rd::dist::init_process_group(env, options);
}

// The run's last lines: what the held-out evaluation measured (exact match for tasks with
// answers; loss, perplexity and bits per byte for text), where the checkpoint and metrics are.
void print_result(const rd::train::TrainResult& r, const TrainConfig& c) {
  if (r.stopped) {
    std::printf("stopped at step %lld; checkpoint %s (resume with the same command)\n",
                static_cast<long long>(r.steps_done), r.checkpoint.c_str());
    return;
  }
  const rd::train::EvalResult& e = r.final_eval;
  std::printf("done: %lld steps in %.0f s", static_cast<long long>(r.steps_done), r.seconds);
  if (r.target_step) {
    std::printf(" (stopped at the target: %.1f%% exact match at step %lld)", 100 * r.target_exact_match,
                static_cast<long long>(*r.target_step));
  }
  std::printf("; ");
  if (e.has_answers) {
    std::printf("held-out exact match %.1f%% (%lld of %lld samples), answer tokens %.1f%%, loss %.4f\n",
                100 * e.accuracy.exact_match(), static_cast<long long>(e.accuracy.exact_samples),
                static_cast<long long>(e.accuracy.samples), 100 * e.accuracy.token_accuracy(), e.loss);
  } else {
    std::printf("held-out loss %.4f, perplexity %.3f", e.loss, e.perplexity);
    if (e.bits_per_byte) std::printf(", %.3f bits per byte", *e.bits_per_byte);
    std::printf(" (%lld tokens)\n", static_cast<long long>(e.tokens));
  }
  std::printf("checkpoint %s\nmetrics %s/metrics.jsonl\n", r.checkpoint.c_str(), c.out_dir.c_str());
}

int train() {
  TrainConfig c = config_from_flags();
  if (const int threads = absl::GetFlag(FLAGS_threads); threads > 0) rd::set_num_threads(threads);
  std::shared_ptr<rd::dist::Communicator> world = world_from_launcher(c);
  const bool root = !world || world->rank() == 0;
  std::signal(SIGINT, on_interrupt);
  std::signal(SIGTERM, on_interrupt);
  rd::train::Trainer trainer(c, world);
  if (root && trainer.step() > 0) {
    std::printf("resuming at step %lld from %s\n", static_cast<long long>(trainer.step()),
                c.out_dir.c_str());
  }
  const rd::train::TrainResult r = trainer.run(&g_stop_requested);
  if (root) print_result(r, c);
  return 0;
}

// Samples from a checkpoint: it reads (and verifies) only the weights and the configuration,
// so a damaged optimizer file does not stand in the way.
int sample() {
  check_flag_ranges();
  std::string path = absl::GetFlag(FLAGS_checkpoint);
  RD_CHECK(!path.empty(), kInvalidArgument, "sample: --checkpoint is required");
  const rd::Device device = parse_device(absl::GetFlag(FLAGS_device));
  if (!std::filesystem::exists(std::filesystem::path(path) / "manifest.json")) {
    // A run folder: its newest checkpoint.
    const auto latest = rd::train::latest_checkpoint((std::filesystem::path(path) / "checkpoints").string());
    RD_CHECK(latest.has_value(), kInvalidArgument, "sample: --checkpoint '", path,
             "' is neither a checkpoint nor a run folder with checkpoints");
    path = *latest;
  }
  const rd::train::CheckpointContents ck =
      rd::train::load_checkpoint(path, rd::train::CheckpointParts::kWeights);
  TrainConfig c = rd::train::config_from_checkpoint(ck.trainer_state);
  rd::Generator gen(c.seed);
  rd::train::LanguageModel model(c.model, gen, rd::TensorOptions(rd::DType::kFloat32).with_device(device));
  model.load_state_dict(ck.model);
  const rd::train::ByteTokenizer tokenizer;
  const std::vector<int32_t> prompt = tokenizer.encode(absl::GetFlag(FLAGS_prompt));
  const std::vector<int32_t> out =
      rd::train::generate(model, prompt.empty() ? std::vector<int32_t>{rd::train::ByteTokenizer::kBos} : prompt,
                          absl::GetFlag(FLAGS_max_new_tokens), absl::GetFlag(FLAGS_temperature),
                          absl::GetFlag(FLAGS_top_k), absl::GetFlag(FLAGS_seed));
  std::printf("%s\n", tokenizer.decode(out).c_str());
  return 0;
}

// `text` broken at spaces into lines of at most `width` characters, each after `indent`.
std::string wrapped(const std::string& text, size_t width, const std::string& indent) {
  std::string out, line;
  std::istringstream words(text);
  for (std::string word; words >> word;) {
    if (!line.empty() && line.size() + 1 + word.size() > width) {
      out += indent + line + "\n";
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
  }
  return out + indent + line + "\n";
}

bool defined_here(std::string_view file) { return file.find("train_main.") != std::string_view::npos; }

// --help (also -h, --helpshort) lists this program's flags, --helpfull every flag (Abseil's
// too); both exit 0. Abseil's own handling exits 1 after help, which scripts take for a
// failure, so these are answered before absl::ParseCommandLine sees them.
bool print_help_if_asked(int argc, char** argv) {
  bool asked = false, full = false;
  for (int i = 1; i < argc && std::string_view(argv[i]) != "--"; ++i) {
    const std::string_view arg = argv[i];
    for (const char* name : {"-h", "-help", "--help", "-helpshort", "--helpshort"}) asked |= arg == name;
    full |= arg == "-helpfull" || arg == "--helpfull";
  }
  if (!asked && !full) return false;
  std::vector<const absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (full || defined_here(flag->Filename())) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(), [](const auto* a, const auto* b) { return a->Name() < b->Name(); });
  std::printf("rd_train: %s\n\nFlags:\n", std::string(absl::ProgramUsageMessage()).c_str());
  for (const absl::CommandLineFlag* flag : flags) {
    std::printf("  --%s (default: %s)\n%s", std::string(flag->Name()).c_str(),
                flag->DefaultValue().empty() ? "empty" : flag->DefaultValue().c_str(),
                wrapped(flag->Help(), 84, "      ").c_str());
  }
  std::printf("\n--flagfile=FILE reads flags from a file (train/configs/); later flags override it.%s\n",
              full ? "" : "\n--helpfull also lists Abseil's own flags.");
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "trains a long-context language model with dilated attention.\n"
      "  rd_train [--flags]         train (defaults: the passkey task, a GPU if present)\n"
      "  rd_train sample --checkpoint=DIR --prompt=TEXT\n"
      "See docs/training.md.");
  // Abseil's --helpshort, --helpon and --helpmatch then find this program's flags too.
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return defined_here(std::string_view(file.data(), file.size()));
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  if (print_help_if_asked(argc, argv)) return 0;
  const std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  try {
    if (args.size() >= 2 && std::string(args[1]) == "sample") return sample();
    if (args.size() >= 2) {
      std::fprintf(stderr, "rd_train: unknown command '%s' (train is the default; or sample)\n", args[1]);
      return 2;
    }
    return train();
  } catch (const std::exception& e) {  // rd::Error names the flag or the file
    std::fprintf(stderr, "rd_train: %s\n", e.what());
    return 1;
  }
}
