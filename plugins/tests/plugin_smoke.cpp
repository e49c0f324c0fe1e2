// Host-only smoke test of the TensorRT wrappers: creators, fields, dtype/format rules, shape
// checks, serialization round trip, and the arguments enqueue hands to the kernels.
// Linked with stub kernels below, so it needs neither a GPU nor libnvinfer, only the headers:
//   g++ -std=c++17 -I<trt>/include -I<cuda>/include -Iplugins/include
//       plugins/src/tensorrt/*.cpp plugins/tests/plugin_smoke.cpp -o plugin_smoke && ./plugin_smoke
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "NvInferRuntime.h"
#include "eagle31_kernels.h"

using namespace nvinfer1;

extern "C" IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);

// ---- stub kernels: record what the plugin asked for -------------------------------------------
namespace {
struct Call {
    std::string op;
    int dtype = -1;
    int32_t sources = 0;
    int64_t rows = 0, hidden_in = 0, hidden_out = 0;
    float eps = 0;
    int32_t flag = -1;
} g_last;
}  // namespace

extern "C" int eagle31_fc_norm_cuda(int dtype, const void* const*, int32_t num_sources, const void*, void*,
                                    int64_t rows, int64_t hidden_in, int64_t hidden_out, float eps, int32_t has_norm,
                                    void*) {
    g_last = Call{"fc_norm", dtype, num_sources, rows, hidden_in, hidden_out, eps, has_norm};
    return EAGLE31_OK;
}

extern "C" int eagle31_post_norm_feedback_cuda(int dtype, const void*, const void*, const void*, void*, void*,
                                               int64_t rows, int64_t hidden, float eps, int32_t norm_output, void*) {
    g_last = Call{"post_norm_feedback", dtype, 0, rows, hidden, hidden, eps, norm_output};
    return EAGLE31_OK;
}

// ---- helpers ------------------------------------------------------------------------------------
namespace {
int g_failures = 0;

void check(bool ok, char const* what) {
    if (!ok) {
        std::printf("FAIL: %s\n", what);
        ++g_failures;
    }
}

IPluginCreatorV3One* creator(char const* name) {
    int32_t n = 0;
    IPluginCreatorInterface* const* all = getCreators(n);
    for (int32_t i = 0; i < n; ++i) {
        auto* c = static_cast<IPluginCreatorV3One*>(all[i]);
        if (std::strcmp(c->getPluginName(), name) == 0) return c;
    }
    return nullptr;
}

Dims dims(std::vector<int64_t> const& d) {
    Dims out{};
    out.nbDims = static_cast<int32_t>(d.size());
    for (size_t i = 0; i < d.size(); ++i) out.d[i] = d[i];
    return out;
}

PluginTensorDesc desc(std::vector<int64_t> const& d, DataType type) {
    PluginTensorDesc out{};
    out.dims = dims(d);
    out.type = type;
    out.format = TensorFormat::kLINEAR;
    out.scale = 1.0f;
    return out;
}

DynamicPluginTensorDesc dyn(DataType type, TensorFormat format = TensorFormat::kLINEAR) {
    DynamicPluginTensorDesc out{};
    out.desc.type = type;
    out.desc.format = format;
    return out;
}

std::unique_ptr<IPluginV3> create(char const* name, std::vector<PluginField> const& fields) {
    PluginFieldCollection fc{static_cast<int32_t>(fields.size()), fields.data()};
    return std::unique_ptr<IPluginV3>(creator(name)->createPlugin("node", &fc, TensorRTPhase::kBUILD));
}

template <typename T>
T* cap(IPluginV3& p, PluginCapabilityType type) {
    return static_cast<T*>(p.getCapabilityInterface(type));
}

// ---- tests --------------------------------------------------------------------------------------
void test_registry() {
    int32_t n = 0;
    IPluginCreatorInterface* const* all = getCreators(n);
    check(n == 2 && all != nullptr, "getCreators returns two creators");
    for (char const* name : {"Eagle31FcNorm", "Eagle31PostNormFeedback"}) {
        IPluginCreatorV3One* c = creator(name);
        check(c != nullptr, "creator found by plugin name");
        if (!c) continue;
        check(std::strcmp(c->getPluginNamespace(), "eagle31") == 0, "namespace is eagle31");
        check(std::strcmp(c->getPluginVersion(), "1") == 0, "version is 1");
        check(std::strcmp(c->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") == 0, "creator is IPluginCreatorV3One");
    }
}

void test_fc_norm() {
    int32_t k = 3, has_norm = 1;
    float eps = 1e-5f;
    auto plugin = create("Eagle31FcNorm", {{"num_sources", &k, PluginFieldType::kINT32, 1},
                                           {"eps", &eps, PluginFieldType::kFLOAT32, 1},
                                           {"has_norm", &has_norm, PluginFieldType::kINT32, 1}});
    check(plugin != nullptr, "FcNorm created from valid fields");
    if (!plugin) return;
    auto* core = cap<IPluginV3OneCore>(*plugin, PluginCapabilityType::kCORE);
    auto* build = cap<IPluginV3OneBuild>(*plugin, PluginCapabilityType::kBUILD);
    auto* run = cap<IPluginV3OneRuntime>(*plugin, PluginCapabilityType::kRUNTIME);
    check(std::strcmp(core->getPluginName(), "Eagle31FcNorm") == 0, "FcNorm core name");
    check(build->getNbOutputs() == 1, "FcNorm has one output");

    DataType in_types[4] = {DataType::kBF16, DataType::kBF16, DataType::kBF16, DataType::kBF16};
    DataType out_type = DataType::kFLOAT;
    check(build->getOutputDataTypes(&out_type, 1, in_types, 4) == 0 && out_type == DataType::kBF16,
          "FcNorm output dtype follows the sources");

    DynamicPluginTensorDesc io[5] = {dyn(DataType::kHALF), dyn(DataType::kHALF), dyn(DataType::kHALF),
                                     dyn(DataType::kHALF), dyn(DataType::kHALF)};
    check(build->supportsFormatCombination(0, io, 4, 1), "FcNorm accepts fp16");
    io[4] = dyn(DataType::kFLOAT);
    check(!build->supportsFormatCombination(4, io, 4, 1), "FcNorm rejects mixed dtypes");
    io[0] = dyn(DataType::kINT8);
    check(!build->supportsFormatCombination(0, io, 4, 1), "FcNorm rejects int8");
    io[0] = dyn(DataType::kHALF, TensorFormat::kCHW32);
    check(!build->supportsFormatCombination(0, io, 4, 1), "FcNorm rejects non-linear formats");

    PluginTensorDesc in[4] = {desc({2, 5, 16}, DataType::kBF16), desc({2, 5, 16}, DataType::kBF16),
                              desc({2, 5, 16}, DataType::kBF16), desc({24, 48}, DataType::kBF16)};
    PluginTensorDesc out[1] = {desc({2, 5, 24}, DataType::kBF16)};
    check(run->onShapeChange(in, 4, out, 1) == 0, "FcNorm accepts matching shapes");
    void const* inputs[4] = {in, in, in, in};
    void* outputs[1] = {out};
    check(run->enqueue(in, out, inputs, outputs, nullptr, nullptr) == 0, "FcNorm enqueue succeeds");
    check(g_last.op == "fc_norm" && g_last.dtype == EAGLE31_BFLOAT16 && g_last.sources == 3 && g_last.rows == 10 &&
              g_last.hidden_in == 16 && g_last.hidden_out == 24 && g_last.eps == eps && g_last.flag == 1,
          "FcNorm enqueue passes rows, sizes, eps and has_norm to the kernel");
    in[3] = desc({24, 47}, DataType::kBF16);
    check(run->onShapeChange(in, 4, out, 1) != 0, "FcNorm rejects a weight of the wrong width");

    // Serialization round trip: the runtime plugin is built from the serialized fields.
    PluginFieldCollection const* saved = run->getFieldsToSerialize();
    std::unique_ptr<IPluginV3> restored(creator("Eagle31FcNorm")->createPlugin("node", saved, TensorRTPhase::kRUNTIME));
    check(restored != nullptr, "FcNorm recreated from its serialized fields");
    if (restored) {
        in[3] = desc({24, 48}, DataType::kBF16);
        auto* run2 = cap<IPluginV3OneRuntime>(*restored, PluginCapabilityType::kRUNTIME);
        check(run2->onShapeChange(in, 4, out, 1) == 0 && run2->enqueue(in, out, inputs, outputs, nullptr, nullptr) == 0,
              "restored FcNorm runs");
        check(g_last.sources == 3 && g_last.eps == eps && g_last.flag == 1, "restored FcNorm keeps its fields");
    }
    std::unique_ptr<IPluginV3> copy(plugin->clone());
    check(copy != nullptr && cap<IPluginV3OneRuntime>(*copy, PluginCapabilityType::kRUNTIME)->getFieldsToSerialize()->nbFields == 3,
          "FcNorm clone serializes its own fields");
}

void test_fc_norm_fields() {
    int32_t bad_flag = 2, k = 3;
    int64_t k64 = 2;
    double eps64 = 1e-6;
    check(create("Eagle31FcNorm", {{"num_sources", &k, PluginFieldType::kINT32, 1},
                                   {"has_norm", &bad_flag, PluginFieldType::kINT32, 1}}) == nullptr,
          "FcNorm rejects has_norm = 2");
    int32_t nine = 9;
    check(create("Eagle31FcNorm", {{"num_sources", &nine, PluginFieldType::kINT32, 1}}) == nullptr,
          "FcNorm rejects more than 8 sources");
    auto plugin = create("Eagle31FcNorm", {{"num_sources", &k64, PluginFieldType::kINT64, 1},
                                           {"epsilon", &eps64, PluginFieldType::kFLOAT64, 1}});
    check(plugin != nullptr, "FcNorm accepts int64 / float64 fields and the epsilon spelling");
    // Without num_sources the plugin takes every input but the last as a source.
    auto inferred = create("Eagle31FcNorm", {});
    check(inferred != nullptr, "FcNorm without num_sources is created");
    if (inferred) {
        auto* run = cap<IPluginV3OneRuntime>(*inferred, PluginCapabilityType::kRUNTIME);
        PluginTensorDesc in[3] = {desc({4, 8}, DataType::kHALF), desc({4, 8}, DataType::kHALF),
                                  desc({6, 16}, DataType::kHALF)};
        PluginTensorDesc out[1] = {desc({4, 6}, DataType::kHALF)};
        void const* inputs[3] = {in, in, in};
        void* outputs[1] = {out};
        check(run->onShapeChange(in, 3, out, 1) == 0 && run->enqueue(in, out, inputs, outputs, nullptr, nullptr) == 0 &&
                  g_last.sources == 2 && g_last.rows == 4 && g_last.flag == 1,
              "FcNorm infers num_sources from its inputs (has_norm defaults to 1)");
    }
}

void test_post_norm_feedback() {
    float eps = 1e-6f;
    int32_t post = 1;
    check(create("Eagle31PostNormFeedback", {{"eps", &eps, PluginFieldType::kFLOAT32, 1}}) == nullptr,
          "PostNormFeedback requires norm_output");
    auto plugin = create("Eagle31PostNormFeedback", {{"eps", &eps, PluginFieldType::kFLOAT32, 1},
                                                     {"norm_output", &post, PluginFieldType::kINT32, 1}});
    check(plugin != nullptr, "PostNormFeedback created from valid fields");
    if (!plugin) return;
    auto* build = cap<IPluginV3OneBuild>(*plugin, PluginCapabilityType::kBUILD);
    auto* run = cap<IPluginV3OneRuntime>(*plugin, PluginCapabilityType::kRUNTIME);
    check(build->getNbOutputs() == 2, "PostNormFeedback has two outputs");
    DataType in_types[3] = {DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT};
    DataType out_types[2] = {DataType::kHALF, DataType::kHALF};
    check(build->getOutputDataTypes(out_types, 2, in_types, 3) == 0 && out_types[0] == DataType::kFLOAT &&
              out_types[1] == DataType::kFLOAT,
          "PostNormFeedback outputs follow the input dtype");
    PluginTensorDesc in[3] = {desc({3, 7, 64}, DataType::kFLOAT), desc({3, 7, 64}, DataType::kFLOAT),
                              desc({64}, DataType::kFLOAT)};
    PluginTensorDesc out[2] = {desc({3, 7, 64}, DataType::kFLOAT), desc({3, 7, 64}, DataType::kFLOAT)};
    void const* inputs[3] = {in, in, in};
    void* outputs[2] = {out, out};
    check(run->onShapeChange(in, 3, out, 2) == 0, "PostNormFeedback accepts matching shapes");
    check(run->enqueue(in, out, inputs, outputs, nullptr, nullptr) == 0 && g_last.op == "post_norm_feedback" &&
              g_last.rows == 21 && g_last.hidden_in == 64 && g_last.flag == 1 && g_last.dtype == EAGLE31_FLOAT32,
          "PostNormFeedback enqueue passes rows, hidden and norm_output to the kernel");
    in[2] = desc({63}, DataType::kFLOAT);
    check(run->onShapeChange(in, 3, out, 2) != 0, "PostNormFeedback rejects a norm weight of the wrong size");
    PluginFieldCollection const* saved = run->getFieldsToSerialize();
    check(saved->nbFields == 2 && std::strcmp(saved->fields[1].name, "norm_output") == 0 &&
              *static_cast<int32_t const*>(saved->fields[1].data) == 1,
          "PostNormFeedback serializes norm_output");
}
}  // namespace

int main() {
    test_registry();
    test_fc_norm();
    test_fc_norm_fields();
    test_post_norm_feedback();
    if (g_failures == 0) std::printf("plugin smoke test: OK\n");
    return g_failures == 0 ? 0 : 1;
}
