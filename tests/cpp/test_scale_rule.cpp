// The loss-scale rule, step by step.
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>

#include "scale_rule.h"

using ampfuse::kernels::apply_scale_rule;

namespace {

struct State {
  float scale;
  std::int32_t growth = 0;
  std::int32_t hysteresis_left;
};

void step(State& s, bool overflow, std::int64_t interval = 3, std::int64_t hysteresis = 1,
          double min_scale = 0.0, double max_scale = std::numeric_limits<double>::infinity()) {
  apply_scale_rule(&s.scale, &s.growth, &s.hysteresis_left, overflow ? 1.0f : 0.0f, 2.0, 0.5,
                   interval, hysteresis, min_scale, max_scale);
}

}  // namespace

TEST_CASE("grows after growth_interval clean steps and backs off on overflow") {
  State s{1024.0f, 0, 1};
  step(s, false);
  step(s, false);
  REQUIRE(s.scale == 1024.0f);
  REQUIRE(s.growth == 2);
  step(s, false);
  REQUIRE(s.scale == 2048.0f);
  REQUIRE(s.growth == 0);
  step(s, false);
  step(s, true);
  REQUIRE(s.scale == 1024.0f);
  REQUIRE(s.growth == 0);
}

TEST_CASE("hysteresis backs off only on the h-th overflow since the last change") {
  State s{1024.0f, 0, 3};
  step(s, true, 3, 3);
  step(s, true, 3, 3);
  REQUIRE(s.scale == 1024.0f);
  REQUIRE(s.hysteresis_left == 1);
  step(s, false, 3, 3);  // a clean step does not refill the budget
  step(s, true, 3, 3);
  REQUIRE(s.scale == 512.0f);
  REQUIRE(s.hysteresis_left == 3);
  for (int i = 0; i < 3; ++i) step(s, false, 3, 3);
  REQUIRE(s.scale == 1024.0f);
}

TEST_CASE("the scale never leaves [min_scale, max_scale] and never becomes inf") {
  State low{1.0f, 0, 1};
  for (int i = 0; i < 10; ++i) step(low, true, 3, 1, 0.25, 1e6);
  REQUIRE(low.scale == 0.25f);

  State high{4096.0f, 0, 1};
  for (int i = 0; i < 30; ++i) step(high, false, 1, 1, 0.0, 10000.0);
  REQUIRE(high.scale == 10000.0f);

  State huge{3.0e38f, 0, 1};
  step(huge, false, 1);
  REQUIRE(huge.scale == 3.0e38f);
  REQUIRE(std::isfinite(huge.scale));
  REQUIRE(huge.growth == 0);
}
