// Eagle31FcNorm as a TensorRT plugin.
//
// Inputs:  source_0 .. source_{k-1}  each [..., Ht], same shape and dtype
//          weight                    [H, k*Ht], the fc weight with the RMSNorm weights folded in
// Output:  y                         [..., H]
// Fields:  num_sources (int32; optional: defaults to the number of inputs - 1),
//          eps (float32; "epsilon" accepted too), has_norm (int32 0/1)
// The weight is an input (an initializer in ONNX, a constant in TensorRT), not a field: it is
// hundreds of MB at production sizes, and as an input it stays refittable and dtype-checked.
#include "fc_norm_plugin.h"

#include <cstring>
#include <exception>
#include <new>

#include "eagle31_kernels.h"

namespace eagle31 {
namespace trt {

using namespace nvinfer1;

FcNormPlugin::FcNormPlugin(int32_t num_sources, float eps, int32_t has_norm)
    : num_sources_(num_sources), eps_(eps), has_norm_(has_norm) {}

// The serialized field list points at this object's members, so a copy must not share it.
FcNormPlugin::FcNormPlugin(FcNormPlugin const& other)
    : IPluginV3(other), IPluginV3OneCore(other), IPluginV3OneBuild(other), IPluginV3OneRuntime(other),
      num_sources_(other.num_sources_), eps_(other.eps_), has_norm_(other.has_norm_) {}

IPluginCapability* FcNormPlugin::getCapabilityInterface(PluginCapabilityType type) noexcept {
    switch (type) {
        case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
        case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
        case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

IPluginV3* FcNormPlugin::clone() noexcept {
    try {
        return new FcNormPlugin(*this);
    } catch (std::exception const& e) {
        log_error(std::string("Eagle31FcNorm clone failed: ") + e.what());
        return nullptr;
    }
}

char const* FcNormPlugin::getPluginName() const noexcept { return kFcNormName; }
char const* FcNormPlugin::getPluginVersion() const noexcept { return kVersion; }
char const* FcNormPlugin::getPluginNamespace() const noexcept { return kNamespace; }
int32_t FcNormPlugin::getNbOutputs() const noexcept { return 1; }

bool FcNormPlugin::resolve_sources(int32_t nbInputs) noexcept {
    if (num_sources_ == 0 && nbInputs >= 2 && nbInputs <= EAGLE31_MAX_SOURCES + 1) num_sources_ = nbInputs - 1;
    return nbInputs == num_sources_ + 1;
}

int32_t FcNormPlugin::configurePlugin(DynamicPluginTensorDesc const* /*in*/, int32_t nbInputs,
                                      DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept {
    if (!resolve_sources(nbInputs) || nbOutputs != 1) {
        log_error("Eagle31FcNorm expects num_sources + 1 inputs (the sources, then the folded weight) and 1 output");
        return -1;
    }
    return 0;
}

int32_t FcNormPlugin::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                                         int32_t nbInputs) const noexcept {
    if (nbOutputs != 1 || nbInputs < 1) return -1;
    outputTypes[0] = inputTypes[0];
    return 0;
}

int32_t FcNormPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
                                      int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
                                      IExprBuilder& /*exprBuilder*/) noexcept {
    if (!resolve_sources(nbInputs) || nbOutputs != 1 || inputs[0].nbDims < 1 || inputs[num_sources_].nbDims != 2) {
        log_error("Eagle31FcNorm: inputs must be k tensors [..., Ht] and a weight [H, k*Ht]");
        return -1;
    }
    outputs[0] = inputs[0];
    outputs[0].d[inputs[0].nbDims - 1] = inputs[num_sources_].d[0];  // [..., H]
    return 0;
}

bool FcNormPlugin::supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                             int32_t nbOutputs) noexcept {
    if (pos < 0 || pos >= nbInputs + nbOutputs) return false;
    PluginTensorDesc const& desc = inOut[pos].desc;
    if (!is_supported_io(desc)) return false;
    return pos == 0 || desc.type == inOut[0].desc.type;  // every tensor shares the first source's dtype
}

bool FcNormPlugin::check_shapes(Dims const* inputs, int32_t nbInputs) const noexcept {
    if (nbInputs != num_sources_ + 1 || inputs[0].nbDims < 1) return false;
    Dims const& first = inputs[0];
    for (int32_t i = 1; i < num_sources_; ++i) {
        if (inputs[i].nbDims != first.nbDims) return false;
        for (int32_t d = 0; d < first.nbDims; ++d) {
            if (inputs[i].d[d] != first.d[d]) return false;
        }
    }
    Dims const& weight = inputs[num_sources_];
    int64_t const ht = first.d[first.nbDims - 1];
    return weight.nbDims == 2 && weight.d[1] == ht * num_sources_;
}

int32_t FcNormPlugin::onShapeChange(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* /*out*/,
                                    int32_t nbOutputs) noexcept {
    if (nbOutputs != 1 || !resolve_sources(nbInputs)) return -1;
    Dims dims[EAGLE31_MAX_SOURCES + 1];
    for (int32_t i = 0; i < nbInputs; ++i) dims[i] = in[i].dims;
    if (!check_shapes(dims, nbInputs)) {
        log_error("Eagle31FcNorm: sources must share one shape [..., Ht] and the weight must be [H, num_sources*Ht]");
        return -1;
    }
    return 0;
}

int32_t FcNormPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
                              void const* const* inputs, void* const* outputs, void* /*workspace*/,
                              cudaStream_t stream) noexcept {
    Dims const& src = inputDesc[0].dims;
    int64_t const ht = src.d[src.nbDims - 1];
    int64_t const h = inputDesc[num_sources_].dims.d[0];
    int const status = eagle31_fc_norm_cuda(kernel_dtype(outputDesc[0].type), inputs, num_sources_,
                                            inputs[num_sources_], outputs[0], leading_volume(src), ht, h, eps_,
                                            has_norm_, stream);
    if (status != EAGLE31_OK) log_error("Eagle31FcNorm kernel failed with status " + std::to_string(status));
    return status;
}

IPluginV3* FcNormPlugin::attachToContext(IPluginResourceContext* /*context*/) noexcept { return clone(); }

PluginFieldCollection const* FcNormPlugin::getFieldsToSerialize() noexcept {
    serialized_.fields = {
        PluginField("num_sources", &num_sources_, PluginFieldType::kINT32, 1),
        PluginField("eps", &eps_, PluginFieldType::kFLOAT32, 1),
        PluginField("has_norm", &has_norm_, PluginFieldType::kINT32, 1),
    };
    serialized_.finalize();
    return &serialized_.collection;
}

// ------------------------------------------------------------------------------------------

FcNormCreator::FcNormCreator() {
    fields_.fields = {
        PluginField("num_sources", nullptr, PluginFieldType::kINT32, 1),
        PluginField("eps", nullptr, PluginFieldType::kFLOAT32, 1),
        PluginField("has_norm", nullptr, PluginFieldType::kINT32, 1),
    };
    fields_.finalize();
}

char const* FcNormCreator::getPluginName() const noexcept { return kFcNormName; }
char const* FcNormCreator::getPluginVersion() const noexcept { return kVersion; }
char const* FcNormCreator::getPluginNamespace() const noexcept { return kNamespace; }
PluginFieldCollection const* FcNormCreator::getFieldNames() noexcept { return &fields_.collection; }

IPluginV3* FcNormCreator::createPlugin(char const* /*name*/, PluginFieldCollection const* fc,
                                       TensorRTPhase /*phase*/) noexcept {
    int32_t num_sources = 0;  // 0: one source per input but the last (the weight)
    float eps = 1e-6f;  // HF's default; the exporter always writes the drafter's own value
    int32_t has_norm = 1;
    bool ok = fc != nullptr;
    for (int32_t i = 0; ok && i < fc->nbFields; ++i) {
        PluginField const& f = fc->fields[i];
        if (std::strcmp(f.name, "num_sources") == 0) ok = read_int(f, num_sources);
        else if (std::strcmp(f.name, "eps") == 0 || std::strcmp(f.name, "epsilon") == 0) ok = read_float(f, eps);
        else if (std::strcmp(f.name, "has_norm") == 0) ok = read_int(f, has_norm);
    }
    if (!ok || num_sources < 0 || num_sources > EAGLE31_MAX_SOURCES || (has_norm != 0 && has_norm != 1) ||
        !(eps >= 0.0f)) {
        log_error("Eagle31FcNorm: fields must be num_sources (int32, 1..8, or 0/absent: inferred), eps (float32, >= 0), has_norm (int32, 0/1)");
        return nullptr;
    }
    try {
        return new FcNormPlugin(num_sources, eps, has_norm);
    } catch (std::exception const& e) {
        log_error(std::string("Eagle31FcNorm creation failed: ") + e.what());
        return nullptr;
    }
}

}  // namespace trt
}  // namespace eagle31
