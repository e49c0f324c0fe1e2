// Entry points TensorRT looks up when it loads this library with IPluginRegistry::loadLibrary
// (also trtexec --dynamicPlugins, and plans that serialize the library).
#include "NvInferRuntime.h"
#include "fc_norm_plugin.h"
#include "plugin_utils.h"
#include "post_norm_feedback_plugin.h"

// TENSORRTAPI only exports when building TensorRT itself; the library is built with hidden
// visibility, so the two entry points are exported explicitly.
#define EAGLE31_EXPORT __attribute__((visibility("default")))

extern "C" EAGLE31_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
    static eagle31::trt::FcNormCreator fc_norm;
    static eagle31::trt::PostNormFeedbackCreator post_norm_feedback;
    static nvinfer1::IPluginCreatorInterface* const creators[] = {&fc_norm, &post_norm_feedback};
    nbCreators = 2;
    return creators;
}

extern "C" EAGLE31_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder) {
    eagle31::trt::set_logger_finder(finder);
}
