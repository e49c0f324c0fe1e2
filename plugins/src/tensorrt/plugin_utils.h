// Helpers shared by the EAGLE 3.1 TensorRT plugins: names, field parsing, dtype mapping, logging.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "NvInferRuntime.h"

namespace eagle31 {
namespace trt {

constexpr char const* kNamespace = "eagle31";
constexpr char const* kVersion = "1";
constexpr char const* kFcNormName = "Eagle31FcNorm";
constexpr char const* kPostNormFeedbackName = "Eagle31PostNormFeedback";

// Logs through the logger TensorRT hands to the library (setLoggerFinder), else to stderr.
void log_error(std::string const& message) noexcept;
void set_logger_finder(nvinfer1::ILoggerFinder* finder) noexcept;

// Reads a scalar field whatever integer / float width the producer chose (the ONNX parser converts
// attributes to the type getFieldNames() advertises, but Python callers often pass int64/float64).
bool read_int(nvinfer1::PluginField const& field, int32_t& value) noexcept;
bool read_float(nvinfer1::PluginField const& field, float& value) noexcept;

// Our kernels' dtype code for a TensorRT type, or -1 when unsupported.
int kernel_dtype(nvinfer1::DataType type) noexcept;

bool is_supported_io(nvinfer1::PluginTensorDesc const& desc) noexcept;

// Product of all dimensions but the last (the number of rows a [..., hidden] tensor holds).
int64_t leading_volume(nvinfer1::Dims const& dims) noexcept;

// The field list a creator advertises; holds storage for the collection's pointer.
struct FieldList {
    std::vector<nvinfer1::PluginField> fields;
    nvinfer1::PluginFieldCollection collection{};

    void finalize() noexcept {
        collection.nbFields = static_cast<int32_t>(fields.size());
        collection.fields = fields.data();
    }
};

}  // namespace trt
}  // namespace eagle31
