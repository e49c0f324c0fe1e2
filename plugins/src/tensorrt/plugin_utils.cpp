#include "plugin_utils.h"

#include "eagle31_kernels.h"

#include <atomic>
#include <cstdio>

namespace eagle31 {
namespace trt {

namespace {
std::atomic<nvinfer1::ILoggerFinder*> g_logger_finder{nullptr};
}

void set_logger_finder(nvinfer1::ILoggerFinder* finder) noexcept {
    nvinfer1::ILoggerFinder* expected = nullptr;
    g_logger_finder.compare_exchange_strong(expected, finder);  // the first finder wins, as in TensorRT's own
}

void log_error(std::string const& message) noexcept {
    std::string const line = std::string("[eagle31] ") + message;
    nvinfer1::ILoggerFinder* finder = g_logger_finder.load();
    nvinfer1::ILogger* logger = finder ? finder->findLogger() : nullptr;
    if (logger) {
        logger->log(nvinfer1::ILogger::Severity::kERROR, line.c_str());
    } else {
        std::fprintf(stderr, "%s\n", line.c_str());
    }
}

bool read_int(nvinfer1::PluginField const& field, int32_t& value) noexcept {
    using nvinfer1::PluginFieldType;
    if (field.data == nullptr || field.length < 1) return false;
    switch (field.type) {
        case PluginFieldType::kINT8: value = *static_cast<int8_t const*>(field.data); return true;
        case PluginFieldType::kINT16: value = *static_cast<int16_t const*>(field.data); return true;
        case PluginFieldType::kINT32: value = *static_cast<int32_t const*>(field.data); return true;
        case PluginFieldType::kINT64: value = static_cast<int32_t>(*static_cast<int64_t const*>(field.data)); return true;
        default: return false;
    }
}

bool read_float(nvinfer1::PluginField const& field, float& value) noexcept {
    using nvinfer1::PluginFieldType;
    if (field.data == nullptr || field.length < 1) return false;
    switch (field.type) {
        case PluginFieldType::kFLOAT32: value = *static_cast<float const*>(field.data); return true;
        case PluginFieldType::kFLOAT64: value = static_cast<float>(*static_cast<double const*>(field.data)); return true;
        default: return false;
    }
}

int kernel_dtype(nvinfer1::DataType type) noexcept {
    switch (type) {
        case nvinfer1::DataType::kFLOAT: return EAGLE31_FLOAT32;
        case nvinfer1::DataType::kHALF: return EAGLE31_FLOAT16;
        case nvinfer1::DataType::kBF16: return EAGLE31_BFLOAT16;
        default: return -1;
    }
}

bool is_supported_io(nvinfer1::PluginTensorDesc const& desc) noexcept {
    return desc.format == nvinfer1::TensorFormat::kLINEAR && kernel_dtype(desc.type) >= 0;
}

int64_t leading_volume(nvinfer1::Dims const& dims) noexcept {
    int64_t volume = 1;
    for (int32_t i = 0; i + 1 < dims.nbDims; ++i) volume *= dims.d[i];
    return volume;
}

}  // namespace trt
}  // namespace eagle31
