// Eagle31PostNormFeedback as a TensorRT plugin.
//
// Inputs:  residual [..., H], update [..., H], norm_weight [H]   (one dtype)
// Outputs: normed [..., H]   RMSNorm(residual + update) * norm_weight, for lm_head
//          fed_back [..., H] normed when norm_output = 1 (EAGLE 3.1), else residual + update
// Fields:  eps (float32; "epsilon" accepted too), norm_output (int32 0/1, required)
#include "post_norm_feedback_plugin.h"

#include <cstring>
#include <exception>
#include <new>

#include "eagle31_kernels.h"

namespace eagle31 {
namespace trt {

using namespace nvinfer1;

namespace {
constexpr int32_t kInputs = 3;
constexpr int32_t kOutputs = 2;

bool same_dims(Dims const& a, Dims const& b) noexcept {
    if (a.nbDims != b.nbDims) return false;
    for (int32_t d = 0; d < a.nbDims; ++d) {
        if (a.d[d] != b.d[d]) return false;
    }
    return true;
}
}  // namespace

PostNormFeedbackPlugin::PostNormFeedbackPlugin(float eps, int32_t norm_output) : eps_(eps), norm_output_(norm_output) {}

// The serialized field list points at this object's members, so a copy must not share it.
PostNormFeedbackPlugin::PostNormFeedbackPlugin(PostNormFeedbackPlugin const& other)
    : IPluginV3(other), IPluginV3OneCore(other), IPluginV3OneBuild(other), IPluginV3OneRuntime(other),
      eps_(other.eps_), norm_output_(other.norm_output_) {}

IPluginCapability* PostNormFeedbackPlugin::getCapabilityInterface(PluginCapabilityType type) noexcept {
    switch (type) {
        case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
        case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
        case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

IPluginV3* PostNormFeedbackPlugin::clone() noexcept {
    try {
        return new PostNormFeedbackPlugin(*this);
    } catch (std::exception const& e) {
        log_error(std::string("Eagle31PostNormFeedback clone failed: ") + e.what());
        return nullptr;
    }
}

char const* PostNormFeedbackPlugin::getPluginName() const noexcept { return kPostNormFeedbackName; }
char const* PostNormFeedbackPlugin::getPluginVersion() const noexcept { return kVersion; }
char const* PostNormFeedbackPlugin::getPluginNamespace() const noexcept { return kNamespace; }
int32_t PostNormFeedbackPlugin::getNbOutputs() const noexcept { return kOutputs; }

int32_t PostNormFeedbackPlugin::configurePlugin(DynamicPluginTensorDesc const* /*in*/, int32_t nbInputs,
                                                DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept {
    if (nbInputs != kInputs || nbOutputs != kOutputs) {
        log_error("Eagle31PostNormFeedback expects inputs (residual, update, norm_weight) and outputs (normed, fed_back)");
        return -1;
    }
    return 0;
}

int32_t PostNormFeedbackPlugin::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                                                   int32_t nbInputs) const noexcept {
    if (nbOutputs != kOutputs || nbInputs != kInputs) return -1;
    outputTypes[0] = inputTypes[0];
    outputTypes[1] = inputTypes[0];
    return 0;
}

int32_t PostNormFeedbackPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs,
                                                DimsExprs const* /*shapeInputs*/, int32_t /*nbShapeInputs*/,
                                                DimsExprs* outputs, int32_t nbOutputs,
                                                IExprBuilder& /*exprBuilder*/) noexcept {
    if (nbInputs != kInputs || nbOutputs != kOutputs || inputs[0].nbDims < 1) return -1;
    outputs[0] = inputs[0];
    outputs[1] = inputs[0];
    return 0;
}

bool PostNormFeedbackPlugin::supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut,
                                                       int32_t nbInputs, int32_t nbOutputs) noexcept {
    if (pos < 0 || pos >= nbInputs + nbOutputs) return false;
    PluginTensorDesc const& desc = inOut[pos].desc;
    if (!is_supported_io(desc)) return false;
    return pos == 0 || desc.type == inOut[0].desc.type;
}

int32_t PostNormFeedbackPlugin::onShapeChange(PluginTensorDesc const* in, int32_t nbInputs,
                                              PluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept {
    if (nbInputs != kInputs || nbOutputs != kOutputs) return -1;
    Dims const& x = in[0].dims;
    bool const ok = x.nbDims >= 1 && same_dims(x, in[1].dims) && in[2].dims.nbDims == 1 &&
                    in[2].dims.d[0] == x.d[x.nbDims - 1];
    if (!ok) {
        log_error("Eagle31PostNormFeedback: residual and update must share [..., H] and norm_weight must be [H]");
        return -1;
    }
    return 0;
}

int32_t PostNormFeedbackPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
                                        void const* const* inputs, void* const* outputs, void* /*workspace*/,
                                        cudaStream_t stream) noexcept {
    Dims const& x = inputDesc[0].dims;
    int const status = eagle31_post_norm_feedback_cuda(kernel_dtype(outputDesc[0].type), inputs[0], inputs[1],
                                                       inputs[2], outputs[0], outputs[1], leading_volume(x),
                                                       x.d[x.nbDims - 1], eps_, norm_output_, stream);
    if (status != EAGLE31_OK) log_error("Eagle31PostNormFeedback kernel failed with status " + std::to_string(status));
    return status;
}

IPluginV3* PostNormFeedbackPlugin::attachToContext(IPluginResourceContext* /*context*/) noexcept { return clone(); }

PluginFieldCollection const* PostNormFeedbackPlugin::getFieldsToSerialize() noexcept {
    serialized_.fields = {
        PluginField("eps", &eps_, PluginFieldType::kFLOAT32, 1),
        PluginField("norm_output", &norm_output_, PluginFieldType::kINT32, 1),
    };
    serialized_.finalize();
    return &serialized_.collection;
}

// ------------------------------------------------------------------------------------------

PostNormFeedbackCreator::PostNormFeedbackCreator() {
    fields_.fields = {
        PluginField("eps", nullptr, PluginFieldType::kFLOAT32, 1),
        PluginField("norm_output", nullptr, PluginFieldType::kINT32, 1),
    };
    fields_.finalize();
}

char const* PostNormFeedbackCreator::getPluginName() const noexcept { return kPostNormFeedbackName; }
char const* PostNormFeedbackCreator::getPluginVersion() const noexcept { return kVersion; }
char const* PostNormFeedbackCreator::getPluginNamespace() const noexcept { return kNamespace; }
PluginFieldCollection const* PostNormFeedbackCreator::getFieldNames() noexcept { return &fields_.collection; }

IPluginV3* PostNormFeedbackCreator::createPlugin(char const* /*name*/, PluginFieldCollection const* fc,
                                                 TensorRTPhase /*phase*/) noexcept {
    float eps = 1e-6f;  // HF's default; the exporter always writes the drafter's own value
    int32_t norm_output = -1;  // required: guessing the feedback convention is the bug this plugin exists to avoid
    bool ok = fc != nullptr;
    for (int32_t i = 0; ok && i < fc->nbFields; ++i) {
        PluginField const& f = fc->fields[i];
        if (std::strcmp(f.name, "eps") == 0 || std::strcmp(f.name, "epsilon") == 0) ok = read_float(f, eps);
        else if (std::strcmp(f.name, "norm_output") == 0) ok = read_int(f, norm_output);
    }
    if (!ok || (norm_output != 0 && norm_output != 1) || !(eps >= 0.0f)) {
        log_error("Eagle31PostNormFeedback: fields must be eps (float32, >= 0) and norm_output (int32, 0/1, required)");
        return nullptr;
    }
    try {
        return new PostNormFeedbackPlugin(eps, norm_output);
    } catch (std::exception const& e) {
        log_error(std::string("Eagle31PostNormFeedback creation failed: ") + e.what());
        return nullptr;
    }
}

}  // namespace trt
}  // namespace eagle31
